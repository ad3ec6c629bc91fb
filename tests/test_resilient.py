"""Link cuts through netsim on loopback: local generation, reconnection, reconciliation, nothing lost."""

from __future__ import annotations

import threading

import pytest

from client.decode import speculative_generate
from client.drafters.base import NoDrafter
from client.drafters.moa import MoADrafter
from client.resilient import Backoff, resilient_generate
from client.verifiers import LocalVerifier, RemoteVerifier, payload_spec
from netsim import simulated_link
from tests.test_moa import make_moa

PROMPT = [5, 9, 14, 5, 9, 21, 33, 40, 41, 5, 9]
NEW = 48


@pytest.fixture(scope="module")
def plain(tiny_target):
    return speculative_generate(LocalVerifier(tiny_target), NoDrafter(), PROMPT, NEW).token_ids


def cut_on_round(verifier, link, round_no: int, down_s: float, before=None) -> None:
    """Cut the link just before the ``round_no``-th Verify and restore it ``down_s`` later."""
    original, calls = verifier.verify, []

    def verify(tree, **kw):
        calls.append(1)
        if len(calls) == round_no:
            if before:
                before()
            link.cut()
            threading.Timer(down_s, link.restore).start()
        return original(tree, **kw)

    verifier.verify = verify


def run(tiny_target, tiny_server, netsim_server, policy: str, before=None):
    drafter = MoADrafter(make_moa(tiny_target, 1), width=3, depth=3)
    with simulated_link(tiny_server[0], "none", netsim=netsim_server) as link:
        verifier = RemoteVerifier(link.address, payload=payload_spec(drafter, "kv", "fp16"))
        try:
            cut_on_round(verifier, link, 3, 0.5, before and (lambda: before(verifier)))
            return resilient_generate(verifier, drafter, PROMPT, NEW, on_reconnect=policy, max_tree_nodes=8,
                                      backoff=Backoff(base_s=0.02, cap_s=0.2, seed=1))  # fmt: skip
        finally:
            verifier.shutdown()


def test_a_cut_link_is_bridged_locally_and_verify_restores_the_exact_output(
    tiny_target, tiny_server, netsim_server, plain
):
    gen = run(tiny_target, tiny_server, netsim_server, "verify")
    s = gen.stats
    assert gen.token_ids == plain
    assert all(gen.verified)  # every kept token was verified in the end
    assert s.disconnects == 1 and s.reconnects == 1 and s.local_tokens >= 1 and s.offline_s >= 0.3
    assert s.switch_s[0] < 0.5  # a closed connection is noticed at once, not at the deadline


def test_keep_takes_the_local_tokens_as_they_are(tiny_target, tiny_server, netsim_server, plain):
    gen = run(tiny_target, tiny_server, netsim_server, "keep")
    flags = gen.verified
    first_local = flags.index(False)
    last_local = len(flags) - 1 - flags[::-1].index(False)
    assert all(flags[:first_local]) and not any(flags[first_local : last_local + 1]) and all(flags[last_local + 1 :])
    assert gen.token_ids[:first_local] == plain[:first_local]
    assert gen.stats.local_tokens == last_local + 1 - first_local  # each local token exactly once
    assert len(gen.token_ids) == NEW or gen.finish_reason == "stop"


def test_a_session_the_server_lost_is_reopened_from_history(tiny_target, tiny_server, netsim_server, plain):
    service = tiny_server[1]

    def forget(verifier):
        service.sessions.pop(verifier.session_id)

    gen = run(tiny_target, tiny_server, netsim_server, "verify", before=forget)
    assert gen.token_ids == plain
    assert gen.stats.disconnects == 1 and gen.stats.reconnects == 1
