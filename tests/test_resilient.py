"""Link cuts through netsim on loopback: offline generation, reconnection, settlement, nothing lost."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from client.drafters.base import NoDrafter
from client.drafters.moa import MoADrafter
from client.loop.adaptive import AdaptivePolicy
from client.loop.decode import Settings, generate
from client.loop.offline import Backoff, Resilience
from client.loop.sizing import EXPLORE
from client.net.failures import LinkDown
from client.net.remote import RemoteVerifier
from client.verifiers import LocalVerifier
from netsim import simulated_link
from netsim.harness import Flapper
from netsim.profiles import Profile
from shared.errors import SplitspecError
from shared.payload import PayloadSpec
from tests.conftest import own_server
from tests.test_cli import ROOT, splitspec
from tests.test_moa import make_moa

PROMPT = [5, 9, 14, 5, 9, 21, 33, 40, 41, 5, 9]
NEW = 48
HANG_S = 600.0  # a generation still running after this has hung (not a measurement: they take seconds)


tiny_server = pytest.fixture(scope="module", name="tiny_server")(own_server)  # not the session-wide one


@pytest.fixture(scope="module")
def plain(tiny_target):
    return generate(LocalVerifier(tiny_target), NoDrafter(), PROMPT, NEW).token_ids


def cut_on_round(verifier, link, round_no: int, down_s: float, before=None, silent: bool = False,
                 errors: list | None = None) -> list[float]:  # fmt: skip
    """Cut the link just before the ``round_no``-th Verify and restore it ``down_s`` later; the list
    returned gets the moment of the cut (``time.perf_counter()``), ``errors`` what that Verify raised."""
    verifier.__dict__.pop("verify", None)  # unwrap an earlier cut
    original, calls, cut_at = verifier.verify, [], []

    def verify(tree, **kw):
        calls.append(1)
        cutting = len(calls) == round_no
        if cutting:
            if before:
                before()
            link.cut(silent=silent)
            cut_at.append(time.perf_counter())
            threading.Timer(down_s, link.restore).start()
        try:
            return original(tree, **kw)
        except Exception as exc:
            if cutting and errors is not None:
                errors.append(exc)
            raise

    verifier.verify = verify
    return cut_at


def run(tiny_target, tiny_server, netsim_server, policy: str, before=None, errors: list | None = None):
    drafter = MoADrafter(make_moa(tiny_target, 1), width=3, depth=3)
    with simulated_link(tiny_server[0], "none", netsim=netsim_server) as link:
        verifier = RemoteVerifier(link.address)
        try:
            cut_on_round(verifier, link, 3, 0.5, before and (lambda: before(verifier)), errors=errors)
            return generate(
                verifier, drafter, PROMPT, NEW,
                Settings(
                    spec=PayloadSpec("kv", "fp16"),
                    max_tree_nodes=8,
                    resilience=Resilience(policy, Backoff(base_s=0.02, cap_s=0.2, seed=1)),
                ),
            )  # fmt: skip
        finally:
            verifier.shutdown()


def test_a_cut_link_is_bridged_offline_and_verify_restores_the_exact_output(
    tiny_target, tiny_server, netsim_server, plain
):
    errors = []
    gen = run(tiny_target, tiny_server, netsim_server, "verify", errors=errors)
    s = gen.stats
    assert gen.token_ids == plain
    assert all(gen.verified)  # every kept token was verified in the end
    # one cut; a loaded machine may add a false alarm, which must be bridged the same way
    assert s.disconnects >= 1 and s.reconnects == s.disconnects and s.offline_tokens >= 1 and s.offline_s > 0
    # a closed connection is noticed at once, by the failure it causes (UNAVAILABLE: the call's own, or the
    # heartbeat's probe's), not at the deadline ("Verify unanswered within ...")
    assert len(errors) == 1 and isinstance(errors[0], LinkDown), errors
    assert "UNAVAILABLE" in str(errors[0]), errors


def test_keep_takes_the_offline_tokens_as_they_are(tiny_target, tiny_server, netsim_server, plain):
    gen = run(tiny_target, tiny_server, netsim_server, "keep")
    flags = gen.verified
    first_offline = flags.index(False)
    last_offline = len(flags) - 1 - flags[::-1].index(False)
    assert all(flags[:first_offline]) and not any(flags[first_offline : last_offline + 1])
    assert all(flags[last_offline + 1 :])
    assert gen.token_ids[:first_offline] == plain[:first_offline]
    assert gen.stats.offline_tokens == last_offline + 1 - first_offline  # each offline token exactly once
    assert len(gen.token_ids) == NEW or gen.finish_reason == "stop"


def test_a_session_the_server_lost_is_reopened_from_history(tiny_target, tiny_server, netsim_server, plain):
    service = tiny_server[1]

    def forget(verifier):
        service.sessions.pop(verifier.session_id)

    gen = run(tiny_target, tiny_server, netsim_server, "verify", before=forget)
    assert gen.token_ids == plain
    assert gen.stats.disconnects >= 1 and gen.stats.reconnects == gen.stats.disconnects


def test_twenty_generations_cut_at_random_points_all_end_exactly(tiny_target, tiny_server, netsim_server, plain):
    rng = random.Random(7)
    drafter = MoADrafter(make_moa(tiny_target, 1), width=3, depth=3)
    with simulated_link(tiny_server[0], "none", netsim=netsim_server) as link:
        verifier = RemoteVerifier(link.address)
        try:
            offline = 0
            for i in range(20):
                cut_on_round(verifier, link, rng.randint(1, 8), rng.uniform(0.05, 0.4))
                gen = generate(
                    verifier, drafter, PROMPT, NEW,
                    Settings(
                        spec=PayloadSpec("kv", "int8"),
                        max_tree_nodes=8,
                        resilience=Resilience(backoff=Backoff(base_s=0.02, cap_s=0.2, seed=i)),
                    ),
                )  # fmt: skip
                assert gen.token_ids == plain, i  # nothing lost, nothing duplicated, nothing changed
                assert all(gen.verified) and gen.stats.reconnects == gen.stats.disconnects
                offline += gen.stats.offline_tokens
            assert offline > 0
        finally:
            verifier.shutdown()


def test_a_flapping_link_neither_hangs_nor_spins(tiny_target, tiny_server, netsim_server, plain):
    """Down 100 ms of every 200 ms for the whole generation: it completes, and reconnection polls stay bounded."""
    drafter = MoADrafter(make_moa(tiny_target, 1), width=3, depth=3)
    with simulated_link(tiny_server[0], "none", netsim=netsim_server) as link:
        verifier = RemoteVerifier(link.address)
        flapper = Flapper(netsim_server.client, link.name, 0.2, 0.1).start()
        pool = ThreadPoolExecutor(1, thread_name_prefix="test-flapping")
        try:
            resilience = Resilience(backoff=Backoff(base_s=0.02, cap_s=0.2, seed=3))
            settings = Settings(spec=PayloadSpec("kv", "fp16"), max_tree_nodes=4, resilience=resilience)
            running = pool.submit(generate, verifier, drafter, PROMPT, NEW, settings)
            gen = running.result(timeout=HANG_S)  # a bounded wait: a hung generation fails the test, not the suite
        finally:
            flapper.stop()
            verifier.shutdown()
            pool.shutdown(wait=False)
    s = gen.stats
    assert gen.token_ids == plain and all(gen.verified)
    assert flapper.cuts >= 2 and s.disconnects >= 1
    # no spinning: polls are spaced by the backoff (>= 10 ms: 20 ms base, jitter halves it at worst)
    assert s.reconnect_attempts <= s.offline_s / 0.01 + s.disconnects


def test_a_silent_cut_is_detected_within_two_rtts_and_100ms(tiny_target, tiny_server, netsim_server, plain):
    """Packets vanish, nothing is closed: only the heartbeat or a deadline can tell. The issue's bound is
    2 x RTT + 100 ms from the cut; the assertion allows twice that for a loaded machine (the
    benchmark reports the precise figure)."""
    rtt_ms = 40
    drafter = MoADrafter(make_moa(tiny_target, 1), width=3, depth=3)
    with simulated_link(tiny_server[0], Profile("test-40ms", rtt_ms=rtt_ms), netsim=netsim_server) as link:
        verifier = RemoteVerifier(link.address)
        try:
            cut_at = cut_on_round(verifier, link, 8, 1.0, silent=True)
            gen = generate(
                verifier, drafter, PROMPT, NEW,
                Settings(
                    spec=PayloadSpec("kv", "fp16"),
                    max_tree_nodes=4,
                    resilience=Resilience(backoff=Backoff(base_s=0.02, cap_s=0.2, seed=5)),
                ),
            )  # fmt: skip
        finally:
            verifier.shutdown()
    switch = gen.stats.switched_at[0] - cut_at[0]
    bound = 2 * rtt_ms / 1000 + 0.1
    print(f"silent cut: went offline {1000 * switch:.0f} ms after the cut (bound {1000 * bound:.0f} ms)")
    assert gen.token_ids == plain and all(gen.verified)
    assert gen.stats.offline_tokens >= 1 and gen.stats.reconnects == gen.stats.disconnects >= 1
    assert 0 < switch <= 2 * bound


def test_a_server_killed_and_restarted_mid_generation(tiny_target, tiny_model_dir, netsim_server, plain, tmp_path):
    """A real `splitspec serve` process, SIGKILLed at the third round and started again on the same port:
    the client bridges the gap offline, finds its session gone and reopens it from its own history."""
    from shared.server_process import ServerChild

    child = ServerChild(["--model", str(tiny_model_dir), "--max-tree-nodes", "16", "--max-context", "128",
                         "--threads", "1", "--dtype", "float32"], tmp_path, timeout_s=120)  # fmt: skip
    child.start()
    restarted = []

    def crash():
        child.kill()
        threading.Thread(target=lambda: restarted.append(child.start()), daemon=True).start()

    try:
        drafter = MoADrafter(make_moa(tiny_target, 1), width=3, depth=3)
        with simulated_link(child.address, "none", netsim=netsim_server) as link:
            verifier = RemoteVerifier(link.address)
            try:
                cut_on_round(verifier, link, 3, 0.0, before=crash)
                gen = generate(
                    verifier, drafter, PROMPT, NEW,
                    Settings(
                        spec=PayloadSpec("kv", "fp16"),
                        max_tree_nodes=8,
                        resilience=Resilience(backoff=Backoff(base_s=0.05, cap_s=0.5, seed=2),
                                                     max_offline_s=120),
                    ),
                )  # fmt: skip
            finally:
                verifier.shutdown()
    finally:
        child.stop()
    assert restarted == [child.address]  # the same port: a restart, as the client sees one
    assert gen.token_ids == plain and all(gen.verified)
    assert gen.stats.disconnects >= 1 and gen.stats.reconnects >= 1 and gen.stats.offline_tokens >= 1


def test_fail_ends_with_an_error_naming_the_link(tiny_target, tiny_server, netsim_server):
    drafter = MoADrafter(make_moa(tiny_target, 1), width=3, depth=3)
    with simulated_link(tiny_server[0], "none", netsim=netsim_server) as link:
        verifier = RemoteVerifier(link.address)
        try:
            cut_on_round(verifier, link, 3, 0.3)
            with pytest.raises(SplitspecError, match=f"the link failed \\(server {link.address}: .*on_reconnect fail"):
                generate(
                    verifier, drafter, PROMPT, NEW,
                    Settings(max_tree_nodes=8, resilience=Resilience("fail")),
                )
        finally:
            verifier.shutdown()


def test_acceptance_length_is_one_quantity_in_local_remote_and_surviving_runs(tiny_target, tiny_server, plain):
    """Tokens gained per verification round, whichever verifier and whatever the failure handling: with
    nothing cut, the same generation gives the same rounds and the same acceptance length."""
    runs = {}
    for name in ("local", "remote-verify", "remote-fail"):
        drafter = MoADrafter(make_moa(tiny_target, 1), width=3, depth=3)
        verifier = LocalVerifier(tiny_target) if name == "local" else RemoteVerifier(tiny_server[0])
        resilience = Resilience("fail") if name == "remote-fail" else Resilience()
        try:
            runs[name] = generate(
                verifier, drafter, PROMPT, NEW,
                Settings(max_tree_nodes=8, resilience=resilience),
            )
        finally:
            if name != "local":
                verifier.shutdown()
    local = runs["local"].stats
    for name, gen in runs.items():
        assert gen.token_ids == plain, name
        if gen.stats.disconnects == 0:  # a loaded machine may raise a false alarm: then rounds differ
            assert (gen.stats.rounds, gen.stats.acceptance_length) == (local.rounds, local.acceptance_length), name


def test_the_adaptive_policy_plans_every_round_of_a_surviving_run(tiny_target, tiny_server, netsim_server):
    """With the link survival on (heartbeat, deadlines) the policy is in the loop: its exploring rounds send
    50 % and 25 % of the drafted tree (that it follows the link is checked on the real target,
    whose verification cost grows with the tree: test_real_target)."""
    drafter = MoADrafter(make_moa(tiny_target, 1), width=4, depth=6)
    with simulated_link(tiny_server[0], Profile("test-40ms", rtt_ms=40), netsim=netsim_server) as link:
        verifier = RemoteVerifier(link.address)
        try:
            verifier.connection.probe_link(budget_s=0.5)
            policy = AdaptivePolicy.for_run(verifier, [PayloadSpec("kv", "fp16")], mode="draft")
            gen = generate(verifier, drafter, PROMPT, 24, Settings(policy=policy))
        finally:
            verifier.shutdown()
    assert gen.stats.heartbeat_probes > 0 and gen.token_ids == generate(LocalVerifier(tiny_target), NoDrafter(),
                                                                         PROMPT, 24).token_ids  # fmt: skip
    # what the policy sent (the shared server's own budget may verify fewer, as it learned from earlier tests)
    half, quarter = (decision.nodes for decision in policy.sizing.history[: len(EXPLORE)])
    assert half > quarter > 0 and len(policy.sizing.history) == gen.stats.rounds
    assert all(n <= d.nodes for n, d in zip(gen.stats.tree_nodes, policy.sizing.history, strict=True))


def test_the_cli_survives_a_cut_and_restored_link_with_no_flag(tiny_model_dir, tiny_server, netsim_server):
    """`splitspec generate` against a server whose link goes down mid-answer and comes back: it finishes, exactly
    as the target decodes, with no resilience flag. (Mode draft: a round trip a token keeps the tiny model's answer
    going long enough to be cut; a cut mid-stream is tests/test_stream.py's.)"""
    address, service = tiny_server
    common = ["--model", str(tiny_model_dir), "--prompt", "w5 w6 w7", "--max-new-tokens", "40", "--drafter", "none",
              "--json", "--dtype", "float32", "--mode", "draft"]  # fmt: skip  (the fp32 target tiny_server serves)
    plain = json.loads(splitspec("generate", "--local", *common).stdout)["token_ids"]
    with simulated_link(address, Profile("test-40ms", rtt_ms=40), netsim=netsim_server) as link:
        before = set(service.sessions._sessions)
        proc = subprocess.Popen([sys.executable, "-m", "shared.cli", "generate", "--server", link.address, *common],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            while not set(service.sessions._sessions) - before and time.monotonic() < deadline:
                time.sleep(0.02)  # the CLI imports torch and loads the tokenizer first
            time.sleep(0.3)  # some tokens in
            link.cut()
            time.sleep(0.8)
            link.restore()
            out, err = proc.communicate(timeout=120)
        finally:
            proc.kill()
    assert proc.returncode == 0, err
    result = json.loads(out)
    assert result["token_ids"] == plain and all(result["verified"])
    assert result["stats"]["disconnects"] >= 1 and result["stats"]["reconnects"] >= 1


def test_a_server_child_and_this_process_get_disjoint_cpus():
    """Two machines emulated on one: ``disjoint_cpus`` splits this process's CPUs, and ``pin_process`` moves every
    thread of a child (a thread pool already running included) onto its share."""
    import os
    import subprocess
    import sys

    from shared.server_process import cpus_label, disjoint_cpus, pin_process

    if not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs and CPU affinity")
    assert disjoint_cpus(len(os.sched_getaffinity(0)), 1) is None  # not enough for both: say so, pin nothing
    server, client = disjoint_cpus(1, 1)
    assert len(server) == len(client) == 1 and not server & client and "pinned" in cpus_label((server, client))
    code = ("import threading, time\n"
            "for _ in range(3): threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
            "time.sleep(30)")  # fmt: skip
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        import time

        deadline = time.monotonic() + 10
        while len(os.listdir(f"/proc/{child.pid}/task")) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        pin_process(server, child.pid)
        tids = [int(t) for t in os.listdir(f"/proc/{child.pid}/task")]
        assert len(tids) >= 4 and all(os.sched_getaffinity(t) == server for t in tids)
    finally:
        child.kill()
        child.wait()


def test_a_prompt_that_fills_the_context_is_refused_by_the_opening_not_answered_empty(tiny_target):
    """The loop opens the session before it asks whether the generation is over: a prompt with no room left is the
    prefill's clear error, never an empty answer."""
    prompt = PROMPT * (tiny_target.max_context // len(PROMPT) + 1)
    with pytest.raises(ValueError, match=f"prompt of {len(prompt)} tokens does not fit the context"):
        generate(LocalVerifier(tiny_target), NoDrafter(), prompt, 4)


def test_a_session_lost_as_it_opens_is_opened_again_a_bounded_number_of_times(tiny_target):
    """A replica that dies under an OpenSession (the server answers, the session is gone) costs the generation
    nothing: it opens again and ends as plain decoding. A server that loses every opening is an error after
    ``OPEN_TRIES``; so is the first failure under ``fail``."""
    from client.loop.decode import OPEN_TRIES
    from client.net.failures import SessionLost

    plain = generate(LocalVerifier(tiny_target), NoDrafter(), PROMPT, 12).token_ids

    def losing(losses: int) -> tuple[LocalVerifier, list[int]]:
        verifier, calls = LocalVerifier(tiny_target), []
        opened = verifier.open

        def open_and_lose(prompt_ids, sampling, **kw):
            calls.append(1)
            if len(calls) <= losses:
                raise SessionLost("INTERNAL: the replica died before finishing this task")
            return opened(prompt_ids, sampling, **kw)

        verifier.open = open_and_lose
        return verifier, calls

    verifier, calls = losing(OPEN_TRIES - 1)
    assert generate(verifier, NoDrafter(), PROMPT, 12).token_ids == plain and len(calls) == OPEN_TRIES
    verifier, calls = losing(OPEN_TRIES)
    with pytest.raises(SessionLost, match="the replica died"):
        generate(verifier, NoDrafter(), PROMPT, 12)
    assert len(calls) == OPEN_TRIES
    verifier, calls = losing(1)
    with pytest.raises(SessionLost):
        generate(verifier, NoDrafter(), PROMPT, 12, Settings(resilience=Resilience("fail")))
    assert len(calls) == 1


def test_a_server_that_loses_every_session_is_given_up_on_not_retried_forever(tiny_target, tiny_server):
    """A server that answers but fails every session (INTERNAL, as Ray Serve's proxy reports a dead replica, is a
    lost session): the client reopens a bounded number of times, then ends with an error saying so."""
    import grpc

    from client.loop.offline import SETTLE_LOSSES
    from client.net.failures import SessionLost, rpc_error

    class Internal(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.INTERNAL

        def details(self):
            return "The actor died unexpectedly before finishing this task."

    assert isinstance(rpc_error("a:1", Internal()), SessionLost)
    verifier = RemoteVerifier(tiny_server[0])
    opened, calls = verifier.open, []

    def open_and_lose(prompt_ids, sampling, **kw):
        calls.append(1)
        if len(calls) > 1:  # every reopen fails
            raise rpc_error(verifier.address, Internal())
        return opened(prompt_ids, sampling, **kw)

    verifier.open = open_and_lose
    try:
        drafter = MoADrafter(make_moa(tiny_target, 1), width=3, depth=3)
        original, rounds = verifier.verify, []

        def verify(tree, **kw):  # the session is lost on the third round, and every Verify after
            rounds.append(1)
            if len(rounds) >= 3:
                raise rpc_error(verifier.address, Internal())
            return original(tree, **kw)

        verifier.verify = verify
        with pytest.raises(SplitspecError, match=f"lost the session {SETTLE_LOSSES} times in a row"):
            generate(
                verifier, drafter, PROMPT, NEW,
                Settings(max_tree_nodes=8, resilience=Resilience(heartbeat=False)),
            )
        assert len(calls) - 1 == SETTLE_LOSSES  # one reopen per settlement, then no more
    finally:
        verifier.shutdown()


def test_serve_exits_0_on_sigterm_with_a_generation_under_way(tiny_model_dir, tmp_path):
    """SIGTERM while a client generates: `splitspec serve` ends its calls and exits 0, every time (it used to abort
    with code 134 in about half the tries once it had served, a daemon thread cut off inside a forward: a restart
    under a supervisor looked like a crash). Three tries: a one-in-two abort survives them one time in eight."""
    from shared.server_process import ServerChild

    for attempt in range(3):
        child = ServerChild(["--model", str(tiny_model_dir), "--max-context", "256", "--threads", "1", "--dtype",
                             "float32"], tmp_path / str(attempt), timeout_s=120)  # fmt: skip
        (tmp_path / str(attempt)).mkdir()
        child.start()
        verifier = RemoteVerifier(child.address)
        busy = threading.Thread(target=lambda v=verifier: _generate_quietly(v), daemon=True)
        try:
            generate(verifier, NoDrafter(), PROMPT, 8)  # it has served
            busy.start()  # and is serving when the signal comes
            time.sleep(0.2)  # (not a bound: lets the second generation reach the server)
            child.process.terminate()
            code = child.process.wait(timeout=60)
        finally:
            child.kill()
            busy.join(timeout=30)
            verifier.shutdown()
        log = (tmp_path / str(attempt) / "server.log").read_text()
        assert code == 0, f"attempt {attempt}: exit code {code}\n{log[-2000:]}"


def _generate_quietly(verifier) -> None:
    """A long generation that the server's going away ends (its error is expected here)."""
    try:
        generate(
            verifier, NoDrafter(), PROMPT, 200,
            Settings(resilience=Resilience("fail", heartbeat=False)),
        )
    except Exception:  # noqa: BLE001, S110 - the server went away: that is the point
        pass
