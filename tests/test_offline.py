"""Offline generation with the drafter alone, then settlement by verification: greedy output ends as if never cut."""

from __future__ import annotations

import pytest

from client.drafters.base import NoDrafter
from client.drafters.eagle import EagleDrafter
from client.drafters.independent import IndependentDrafter
from client.drafters.moa import MoADrafter
from client.loop.decode import Settings, generate
from client.loop.offline import offline_token, settle_verify
from client.verifiers import LocalVerifier, first_spec
from shared.acceptance import SamplingParams
from tests.test_eagle_independent import make_model
from tests.test_moa import make_moa

PROMPT = [5, 9, 14, 5, 9, 21, 33, 40, 41, 5, 9]
TOTAL = 40


def drafter(tiny_target, kind: str):
    if kind.startswith("moa"):
        return MoADrafter(make_moa(tiny_target, int(kind[-1])), width=3, depth=3)
    model = make_model(tiny_target, kind)
    return EagleDrafter(model, width=3, depth=3) if kind == "eagle" else IndependentDrafter(model, width=3, depth=3)


@pytest.fixture(scope="module")
def plain(tiny_target):
    return generate(LocalVerifier(tiny_target), NoDrafter(), PROMPT, TOTAL + 8).token_ids


def start(tiny_target, d, online: int = 0):
    """A session on PROMPT with drafter ``d`` begun, and ``online`` tokens (at least) decoded by drafted rounds."""
    verifier = LocalVerifier(tiny_target)
    opened = verifier.open(PROMPT, SamplingParams(), spec=first_spec(verifier, d.payload_specs()))
    d.begin(PROMPT + opened.new_tokens, opened.features)
    out = list(opened.new_tokens)
    online_rounds(verifier, d, out, online)
    return verifier, out


def online_rounds(verifier, d, out: list[int], until: int) -> None:
    while len(out) < until:
        result = verifier.verify(d.propose(8))
        d.absorb(result.new_tokens, result.features)
        out += result.new_tokens


@pytest.mark.parametrize("kind", ["moa-tli0", "moa-tli1", "eagle", "independent"])
@pytest.mark.parametrize("offline_tokens", [1, 7])
def test_offline_then_verify_ends_like_an_uninterrupted_run(tiny_target, plain, kind, offline_tokens):
    d = drafter(tiny_target, kind)
    verifier, out = start(tiny_target, d, online=6)
    tail = [t for t in (offline_token(d) for _ in range(offline_tokens)) if t is not None]
    assert len(tail) == offline_tokens  # every trained drafter keeps generating without the server
    out += settle_verify(verifier, d, tail, max_nodes=3)  # small chunks: the chunk seams are exercised
    online_rounds(verifier, d, out, TOTAL)
    assert out[:TOTAL] == plain[:TOTAL]


@pytest.mark.parametrize("kind", ["moa-tli1", "eagle"])
def test_offline_tokens_the_target_agrees_with_are_all_kept(tiny_target, plain, kind):
    """Offline tokens equal to the target's own continuation: every one is kept, across chunk seams."""
    d = drafter(tiny_target, kind)
    verifier, out = start(tiny_target, d, online=4)
    tail = plain[len(out) : len(out) + 8]
    for token in tail:  # committed without the target, as offline generation does
        offline_token(d)  # advance the drafter's own state ...
        d.rewind(1)
        d.absorb([token])  # ... then commit the token we want instead
    replaced = settle_verify(verifier, d, tail, max_nodes=3)
    assert replaced[:8] == tail and len(replaced) in (8, 9)  # + the target's next token when a chunk ended there
    assert replaced == plain[len(out) : len(out) + len(replaced)]
    out += replaced
    online_rounds(verifier, d, out, TOTAL)
    assert out[:TOTAL] == plain[:TOTAL]


def absorbed(tiny_target, tail_after):
    """A moa-tli1 drafter four online rounds in, then the offline ``tail_after(n)`` (n: the tokens so far) absorbed:
    (drafter, verifier, the tokens so far, the tail)."""
    d = drafter(tiny_target, "moa-tli1")
    verifier, out = start(tiny_target, d, online=4)
    tail = tail_after(len(out))
    for token in tail:
        d.absorb([token])
    return d, verifier, out, tail


def test_a_divergent_local_tail_is_replaced_at_the_first_difference(tiny_target, plain):
    d, verifier, out, tail = absorbed(tiny_target, lambda n: plain[n : n + 3] + [(plain[n + 3] + 1) % 200 + 6, 7, 8])
    n = len(out)
    assert settle_verify(verifier, d, tail, max_nodes=16) == plain[n : n + 4]
    out += plain[n : n + 4]
    online_rounds(verifier, d, out, TOTAL)
    assert out[:TOTAL] == plain[:TOTAL]


def test_an_empty_tail_is_one_plain_round_that_finds_a_lost_session(tiny_target, plain):
    """A cut that made no offline token (prompt lookup with nothing to copy) still asks the server: else a session the
    server lost (a replica replaced) would be resumed, lost again, and so on without end."""
    from client.net.failures import SessionLost

    d = drafter(tiny_target, "eagle")
    verifier, out = start(tiny_target, d, online=6)
    assert settle_verify(verifier, d, [], max_nodes=16) == [plain[len(out)]]

    def lost(tree, timeout_s=None, *, spec=None):
        raise SessionLost("unknown or closed session")

    verifier.verify = lost
    with pytest.raises(SessionLost):
        settle_verify(verifier, d, [], max_nodes=16)


def test_a_long_tail_is_verified_in_chunks_that_grow_while_every_token_is_kept(tiny_target, plain):
    """4 tokens first, then 8, then 16: a tail wrong early costs one small forward, a right one few calls."""
    d, verifier, out, tail = absorbed(tiny_target, lambda n: plain[n : n + 20])
    sizes, verify = [], verifier.verify
    verifier.verify = lambda tree, timeout_s=None, **kw: sizes.append(len(tree)) or verify(tree, timeout_s, **kw)
    assert settle_verify(verifier, d, tail, max_nodes=64)[:20] == tail and sizes == [4, 8, 6]
    out += plain[len(out) : len(out) + 21]
    online_rounds(verifier, d, out, TOTAL)
    assert out[:TOTAL] == plain[:TOTAL]


def test_offline_sampling_draws_from_the_drafters_top_level_reproducibly(tiny_target):
    """Sampling offline: a draw among the drafter's first-level candidates, the same for the same seed;
    a hot temperature leaves the greedy path somewhere, a near-zero one does not."""
    import torch

    def offline(sampling: SamplingParams, seed: int = 0) -> list[int]:
        d = drafter(tiny_target, "moa1")
        start(tiny_target, d)
        generator = torch.Generator().manual_seed(seed)
        return [offline_token(d, sampling, generator) for _ in range(16)]

    greedy = offline(SamplingParams())
    hot = SamplingParams(temperature=5.0, seed=1)
    assert offline(hot, 1) == offline(hot, 1) and offline(hot, 1) != greedy
    assert offline(SamplingParams(temperature=1e-4, seed=1), 1) == greedy
    d = drafter(tiny_target, "moa1")
    start(tiny_target, d)
    first_level = d.propose(8, 1).tokens
    draws = set()
    for s in range(12):  # draw, take it back, draw again
        draws.add(offline_token(d, hot, torch.Generator().manual_seed(s)))
        d.rewind(1)
    assert draws <= set(first_level) and len(draws) >= 2


def cut_until_offline(verifier: LocalVerifier, call_no: int, offline: int):
    """``verifier`` with its ``call_no``-th Verify failing for the link, unreachable until the output holds ``offline``
    unverified tokens (told through the ``on_update`` returned with it): a cut of a set length, no clock involved."""
    import threading

    from client.net.failures import LinkDown

    calls, back, verify = [], threading.Event(), verifier.verify

    def cut(tree, **kw):
        calls.append(1)
        if len(calls) == call_no:
            raise LinkDown("cut by the test")
        return verify(tree, **kw)

    def seen(tokens, verified):
        if verified.count(False) >= offline:
            back.set()

    verifier.verify = cut
    verifier.reachable = lambda timeout_s=1.0: back.is_set()
    return verifier, seen


@pytest.mark.parametrize("writer", ["drafter", "model"])
def test_another_drafter_may_write_the_offline_tokens_and_the_answer_ends_as_plain(tiny_target, plain, writer):
    """``Resilience.offline``: a whole model writes the cut's tokens instead of the drafter (the 0.5B beside MoA on
    the pair). Here the model is the target itself, so every offline token it writes is kept; the drafter follows its
    tokens, so the settlement and the rounds after go on as ever. The link is down until 10 offline tokens exist."""
    from client.drafters.model import ModelDrafter
    from client.loop.offline import Backoff, Resilience

    verifier, seen = cut_until_offline(LocalVerifier(tiny_target), 3, 10)
    offline = ModelDrafter(tiny_target, width=1, vocab=None) if writer == "model" else None
    resilience = Resilience(backoff=Backoff(base_s=0.01, cap_s=0.02, seed=1), max_offline_s=60.0, offline_cap=0.0,
                            heartbeat=False, offline=offline)  # fmt: skip
    gen = generate(
        verifier, drafter(tiny_target, "moa-tli1"), PROMPT, TOTAL,
        Settings(max_tree_nodes=8, resilience=resilience),
        on_update=seen,
    )  # fmt: skip
    assert gen.token_ids == plain[:TOTAL] and all(gen.verified)
    assert gen.stats.disconnects == 1 and gen.stats.offline_tokens >= 10
    if writer == "model":  # the target's own greedy tokens: the server keeps every one
        assert gen.stats.offline_kept == gen.stats.offline_tokens
