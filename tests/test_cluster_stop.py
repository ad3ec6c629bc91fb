"""`splitspec serve --ray` as a process: SIGTERM while a client generates takes the application and the Ray
instance it started down and exits 0 (a module of its own: the cluster tests' Ray instance is down by then)."""

from __future__ import annotations

import threading

import pytest

from client.drafters.base import NoDrafter
from client.loop.decode import Settings, generate
from client.loop.offline import Resilience
from client.net.remote import RemoteVerifier
from shared.server_process import ServerChild

pytest.importorskip("ray", reason="serve --ray needs Ray Serve (in the dev extras)")

PROMPT = [5, 9, 14, 5, 9, 21, 33, 40, 41, 5, 9]


def test_serve_ray_exits_0_on_sigterm_with_a_generation_under_way(tiny_model_dir, tmp_path):
    child = ServerChild(["--ray", "--replicas", "1", "--model", str(tiny_model_dir), "--max-context", "256",
                         "--threads", "1", "--dtype", "float32"], tmp_path, timeout_s=240)  # fmt: skip
    child.start()
    verifier = RemoteVerifier(child.address, connect_timeout_s=30)
    started, ended = threading.Event(), threading.Event()

    def long_generation() -> None:
        try:  # the server's going away ends it: its error is expected
            generate(
                verifier, NoDrafter(), PROMPT, 200,
                Settings(resilience=Resilience("fail", heartbeat=False)),
                on_update=lambda tokens, verified: started.set(),
            )  # fmt: skip
        except Exception:  # noqa: BLE001, S110 - the point of the test
            pass
        finally:
            ended.set()

    busy = threading.Thread(target=long_generation, daemon=True)
    try:
        assert len(generate(verifier, NoDrafter(), PROMPT, 8).token_ids) == 8  # it has served
        busy.start()
        assert started.wait(timeout=60)  # and is serving when the signal comes
        child.process.terminate()
        code = child.process.wait(timeout=120)
        assert ended.wait(timeout=60)  # the client's generation ended too, and did not hang on the vanished server
    finally:
        child.kill()
        verifier.shutdown()
    log = (tmp_path / "server.log").read_text()
    assert code == 0, f"exit code {code}\n{log[-2000:]}"
