"""Pipelined rounds: drafting the next tree while a Verify is in flight (and sending it, chained) changes no token,
for any drafter.

A verifier whose Verify takes a little while (an injected delay, standing in for the link) is verified in a worker
thread while the drafter drafts ahead; nothing here bounds wall-clock time.
"""

from __future__ import annotations

import math
import threading
import time

import grpc
import pytest

from client.drafters import make_drafter
from client.drafters.base import NoDrafter
from client.drafters.eagle import EagleDrafter
from client.drafters.independent import IndependentDrafter
from client.drafters.medusa import MedusaDrafter
from client.drafters.moa import MoADrafter
from client.drafters.model import ModelDrafter
from client.loop.decode import Settings, generate
from client.loop.offline import Backoff, Resilience
from client.net.remote import RemoteVerifier
from client.verifiers import LocalVerifier
from shared.acceptance import SamplingParams
from shared.engine.models import load_target
from shared.tree import DraftTree
from shared.wire import splitspec_pb2 as pb
from shared.wire import splitspec_pb2_grpc as pb_grpc
from tests.test_eagle_independent import make_model
from tests.test_medusa import make_model as make_medusa
from tests.test_moa import make_moa
from tests.test_offline import cut_until_offline
from tests.test_server import TIMEOUT, reference

PROMPT = [5, 9, 14, 5, 9, 21, 33, 40, 41, 5, 9]
NEW = 40
DELAY_S = 0.002  # each Verify's "link": long enough that the drafter drafts while it waits


@pytest.fixture(scope="module")
def plain(tiny_target):
    return generate(LocalVerifier(tiny_target), NoDrafter(), PROMPT, NEW).token_ids


@pytest.fixture(scope="module")
def twin(tiny_model_dir):
    """The tiny target loaded a second time, to draft for the first: a drafter that is always right."""
    return load_target(str(tiny_model_dir))


def slow(verifier: LocalVerifier) -> LocalVerifier:
    verify = verifier.verify

    def delayed(tree, **kw):
        time.sleep(DELAY_S)
        return verify(tree, **kw)

    verifier.verify = delayed
    return verifier


def drafter(tiny_target, twin, kind: str):
    if kind == "model":
        return ModelDrafter(twin, width=2, depth=4, vocab=None, floor=0.0)  # (a random model is never sure)
    if kind.startswith("moa"):
        return MoADrafter(make_moa(tiny_target, int(kind[-1])), width=3, depth=3)
    if kind == "medusa":
        return MedusaDrafter(make_medusa(tiny_target))
    if kind in ("eagle", "independent"):
        cls = EagleDrafter if kind == "eagle" else IndependentDrafter
        return cls(make_model(tiny_target, kind), width=3, depth=3)
    return make_drafter(kind)


KINDS = ["model", "prompt-lookup", "moa-tli0", "moa-tli1", "eagle", "independent", "medusa", "none"]


def test_subtree_and_chain_of_firsts():
    # root -> 10 (0) -> 11 (2) -> 13 (4); root -> 20 (1) -> 21 (3)
    tree = DraftTree([10, 20, 11, 21, 13], [-1, -1, 0, 1, 2], [-0.1, -1.0, -0.3, -1.5, -0.6])
    assert tree.chain_of_firsts() == [0, 2, 4]
    sub = tree.subtree(0)
    assert (sub.tokens, sub.parents) == ([11, 13], [-1, 0])
    assert sub.scores == pytest.approx([-0.2, -0.5])
    assert tree.subtree(1).tokens == [21] and tree.subtree(4).tokens == []
    assert tree.descendants(0) == [2, 4] and tree.descendants(-1) == [0, 1, 2, 3, 4]
    whole = tree.subtree(-1)  # under the root: the tree itself, scores as they are
    assert (whole.tokens, whole.parents, whole.scores) == (tree.tokens, tree.parents, tree.scores)


def test_the_outcome_drafted_ahead_for_is_a_leaf():
    """Greedy: the end of the drafter's first choices; sampling: the leaf its probabilities reach most likely."""
    from client.loop.sizing import likeliest_outcome

    # root -> 10 (0, p .5) -> 11 (2, .5·.3) ; root -> 20 (1, .4, a leaf)
    tree = DraftTree([10, 20, 11], [-1, -1, 0], [math.log(0.5), math.log(0.4), math.log(0.15)])
    assert likeliest_outcome(tree) == (2, pytest.approx(0.15))
    assert likeliest_outcome(tree, greedy=False) == (1, pytest.approx(0.4))
    assert likeliest_outcome(tree, calibration=2.0, greedy=False)[1] == pytest.approx(0.8)
    assert likeliest_outcome(DraftTree()) == (-1, 1.0)
    assert likeliest_outcome(DraftTree.chain([3, 4, 5])) == (2, 1.0)  # a copy: its chain


@pytest.mark.parametrize("kind", KINDS)
def test_pipelined_rounds_give_the_plain_tokens(tiny_target, twin, plain, kind):
    d = drafter(tiny_target, twin, kind)
    gen = generate(
        slow(LocalVerifier(tiny_target)), d, PROMPT, NEW,
        Settings(max_tree_nodes=8, pipeline=True),
    )
    assert gen.token_ids == plain
    s = gen.stats
    assert s.guesses == s.rounds and 0 <= s.guesses_held <= s.guesses
    if kind == "model":  # always right: every verdict is the path guessed and a bonus guessed
        assert s.guesses_held >= s.rounds - 1 and s.acceptance_length > 3


def test_a_held_guess_sends_the_tree_drafted_ahead(tiny_target, twin, plain):
    """With an always-right drafter, every round after the first sends a tree drafted during the round before:
    drafting time is spent ahead, almost none between rounds."""
    gen = generate(
        slow(LocalVerifier(tiny_target)), drafter(tiny_target, twin, "model"), PROMPT, NEW,
        Settings(max_tree_nodes=8, pipeline=True),
    )  # fmt: skip
    unpiped = generate(
        slow(LocalVerifier(tiny_target)), drafter(tiny_target, twin, "model"), PROMPT, NEW,
        Settings(max_tree_nodes=8, pipeline=False),
    )  # fmt: skip
    assert gen.token_ids == unpiped.token_ids == plain
    assert gen.stats.ahead_s > 0 and unpiped.stats.ahead_s == 0 and unpiped.stats.guesses == 0
    assert gen.stats.rounds == unpiped.stats.rounds  # the same trees, only drafted earlier


def test_a_tree_drafted_ahead_is_cut_to_the_rounds_budget(tiny_target, twin, plain):
    """A tree drafted ahead holds more nodes than a round may send (its bonus guesses' subtrees); the one sent is cut
    to the budget, as a fresh tree would be."""
    chain = ModelDrafter(twin, width=1, depth=6, vocab=None, floor=0.0)  # ahead: a chain of 6, 5 under the bonus
    gen = generate(
        slow(LocalVerifier(tiny_target)), chain, PROMPT, NEW,
        Settings(max_tree_nodes=4, pipeline=True),
    )
    assert gen.token_ids == plain and gen.stats.guesses_held > 0
    assert max(gen.stats.tree_nodes) <= 4


@pytest.mark.parametrize("kind", ["moa-tli1", "eagle", "model"])
def test_a_cut_with_a_tree_in_flight_ends_as_plain(tiny_target, twin, plain, kind):
    """The Verify in flight fails for the link while the drafter is ahead of it: the guess is taken back, offline
    generation and the settlement go on as without pipelining."""
    verifier, seen = cut_until_offline(slow(LocalVerifier(tiny_target)), 4, 5)
    resilience = Resilience(backoff=Backoff(base_s=0.01, cap_s=0.02, seed=1), max_offline_s=60.0, offline_cap=0.0,
                            heartbeat=False)  # fmt: skip
    gen = generate(
        verifier, drafter(tiny_target, twin, kind), PROMPT, NEW,
        Settings(max_tree_nodes=8, pipeline=True, resilience=resilience),
        on_update=seen,
    )  # fmt: skip
    assert gen.token_ids == plain and all(gen.verified)
    assert gen.stats.disconnects == 1 and gen.stats.offline_tokens >= 5


@pytest.mark.parametrize("kind", ["moa-tli1", "model"])
def test_over_grpc_pipelining_is_the_default_and_changes_no_token(tiny_target, tiny_server, twin, plain, kind):
    from client.loop.adaptive import AdaptivePolicy

    d = drafter(tiny_target, twin, kind)
    verifier = RemoteVerifier(tiny_server[0], drafter=d)
    try:
        policy = AdaptivePolicy.for_run(verifier, d.payload_specs(), mode="draft")
        gen = generate(verifier, d, PROMPT, NEW, Settings(policy=policy))
    finally:
        verifier.shutdown()
    assert gen.token_ids == plain
    assert gen.stats.guesses > 0


def test_sampled_pipelined_generations_follow_the_targets_distribution(tiny_target, twin):
    """Sampling: which tree the server verifies (drafted ahead or not) changes no distribution. Many seeded 4-token
    continuations, pipelined (an always-right drafter at a low temperature: a fifth of its trees drafted ahead) and
    not, compared by a two-sample chi-square over the continuations seen often enough."""
    from collections import Counter

    from shared.acceptance import SamplingParams
    from tests.test_acceptance import chi2_critical

    def continuations(pipeline: bool, seeds: range) -> Counter:
        d = drafter(tiny_target, twin, "model")
        return Counter(tuple(generate(
            LocalVerifier(tiny_target), d, PROMPT, 4,
            Settings(sampling=SamplingParams(temperature=0.1, seed=s), max_tree_nodes=8, pipeline=pipeline),
        ).token_ids) for s in seeds)  # fmt: skip

    piped, serial = continuations(True, range(300)), continuations(False, range(1000, 1300))
    common = [c for c in set(piped) | set(serial) if piped[c] + serial[c] >= 10]
    rest = (sum(piped.values()) - sum(piped[c] for c in common), sum(serial.values()) - sum(serial[c] for c in common))
    pairs = [(piped[c], serial[c]) for c in common] + [rest]
    stat = sum((a - b) ** 2 / (a + b) for a, b in pairs if a + b)
    assert len(pairs) >= 3 and stat < chi2_critical(len(pairs) - 1), f"chi-square {stat:.1f} over {len(pairs)} bins"


@pytest.mark.parametrize("mode", ["draft", "stream"])
def test_a_model_drafter_prefills_the_prompt_while_the_server_does(tiny_target, tiny_server, twin, plain, mode):
    """Over a link the call that opens the session (OpenSession, or the Decode stream that opens it) is awaited on a
    worker while a model drafter prefills the prompt: each waits here until the other has begun, which, one after the
    other, would not happen before the wait's bound (the test then fails)."""
    import threading

    from client.loop.adaptive import AdaptivePolicy

    d = drafter(tiny_target, twin, "model")
    preparing, opening, prepare = threading.Event(), threading.Event(), d.prepare
    held: list[bool] = []  # each side saw the other under way

    def meet(mine: threading.Event, theirs: threading.Event) -> None:
        mine.set()
        held.append(theirs.wait(timeout=10))

    d.prepare = lambda prompt_ids: meet(preparing, opening) or prepare(prompt_ids)
    verifier = RemoteVerifier(tiny_server[0], drafter=d)
    if mode == "draft":
        open_session = verifier.open
        verifier.open = lambda *a, **kw: meet(opening, preparing) or open_session(*a, **kw)
    else:
        open_decode = verifier.open_decode

        def opening_stream(*a, **kw):
            def chunks():  # (a Decode call starts when its first chunk is asked for)
                meet(opening, preparing)
                yield from open_decode(*a, **kw)

            return chunks()

        verifier.open_decode = opening_stream
    try:
        policy = AdaptivePolicy.for_run(verifier, d.payload_specs(), mode=mode)
        gen = generate(verifier, d, PROMPT, NEW, Settings(policy=policy))
    finally:
        verifier.shutdown()
    assert held == [True, True]
    assert gen.token_ids == plain
    assert d.prepared is None  # begin took the prefilled prompt


def test_in_process_the_first_token_does_not_wait_for_the_drafters_prefill(tiny_target, twin, plain):
    """In process the target's prefill and the drafter's share the CPU: the first token is shown, and the time to it
    counted, before the drafter begins (its prefill, here 5 s on an injected clock)."""
    d = drafter(tiny_target, twin, "model")
    now, shown, begin = [0.0], [], d.begin

    def slow_begin(*args) -> None:
        shown.append(len(updates))
        now[0] += 5.0
        begin(*args)

    d.begin = slow_begin
    updates: list[list[int]] = []
    gen = generate(LocalVerifier(tiny_target), d, PROMPT, NEW, Settings(clock=lambda: now[0]),
                   on_update=lambda out, verified: updates.append(list(out)))  # fmt: skip
    assert gen.token_ids == plain
    assert shown == [1] and updates[0] == plain[:1]  # the first token, then the drafter's prefill
    assert gen.stats.ttft_s < 5.0 <= gen.stats.wall_s


# Chained rounds: a second tree sent before the verdict of the round it follows (``VerifyRequest.assumed``). The
# server verifies it only where the round before committed exactly the tokens it assumed, and answers it stale
# otherwise, computing nothing and rolling nothing back; a chained call that overtakes its round waits for it.

HOLD_S = 0.5  # the most a round's call is held back for the chained one after it (see ``overtaken``)


@pytest.fixture(scope="module")
def stub(tiny_server):
    channel = grpc.insecure_channel(tiny_server[0])
    yield pb_grpc.SplitSpecStub(channel)
    channel.close()


def opened(stub) -> tuple[str, int]:
    reply = stub.OpenSession(pb.OpenSessionRequest(prompt_ids=PROMPT), timeout=TIMEOUT)
    return reply.session_id, reply.length


def test_a_chained_tree_is_verified_only_after_what_it_assumed(stub, tiny_target):
    want = reference(tiny_target, PROMPT, pb.Sampling(), 7)
    sid, length = opened(stub)
    assert stub.Handshake(pb.HandshakeRequest(), timeout=TIMEOUT).limits.chained_verify

    def verify(tokens: list[int], length: int, assumed: list[int] = ()) -> pb.VerifyReply:
        request = pb.VerifyRequest(session_id=sid, tokens=tokens, parents=list(range(-1, len(tokens) - 1)),
                                   length=length, assumed=assumed)  # fmt: skip
        return stub.Verify(request, timeout=TIMEOUT)

    # a plain round commits want[1] (its tree's first node, accepted) and the bonus want[2]; a chained tree after it
    # holds want[3], assumed after want[1] and want[2]
    first = verify([want[1]], length)
    assert list(first.accepted) == [0] and first.bonus_token == want[2] and first.length == length + 2
    wrong = verify([want[3]], length, [want[1], want[2] + 1])
    assert wrong.stale and wrong.length == length + 2 and not wrong.accepted  # and nothing changed:
    chained = verify([want[3]], length, [want[1], want[2]])
    assert not chained.stale and list(chained.accepted) == [0] and chained.bonus_token == want[4]
    assert chained.length == length + 4
    # chained after a chained one: it follows the round that verified after length + 2
    again = verify([want[5]], length + 2, [want[3], want[4]])
    assert not again.stale and again.bonus_token == want[6] and again.length == length + 6
    stale = verify([want[3]], length, [want[1], want[2]])  # the session has moved past it: stale, nothing rolled back
    assert stale.stale and stale.length == length + 6
    with pytest.raises(grpc.RpcError) as info:
        stub.Verify(pb.VerifyRequest(session_id=sid, tokens=[1], parents=[-1], assumed=[1]), timeout=TIMEOUT)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "length" in info.value.details()


def test_a_chained_call_follows_the_round_it_assumed_not_tokens_alike(stub, tiny_target):
    """Sent first, the chained call waits until the round it follows has run, then is verified. The tokens it assumes
    already there — decoded by a stream past what its client took, which the round's own call rolls back — do not
    stand in for that round."""
    want = reference(tiny_target, PROMPT, pb.Sampling(), 6)
    sid, length = opened(stub)
    streamed = stub.Decode(pb.DecodeRequest(session_id=sid, length=length, max_new_tokens=2), timeout=TIMEOUT)
    assert [c.token for c in streamed] == want[1:3]  # the server holds want[1], want[2]; say the client never got them
    chained = stub.Verify.future(pb.VerifyRequest(session_id=sid, tokens=[want[3]], parents=[-1], length=length,
                                                  assumed=[want[1], want[2]]), timeout=TIMEOUT)  # fmt: skip
    with pytest.raises(grpc.FutureTimeoutError):
        chained.result(timeout=0.3)  # (its round has not run: it waits; a slow machine only makes this surer)
    stub.Verify(pb.VerifyRequest(session_id=sid, tokens=[want[1]], parents=[-1], length=length), timeout=TIMEOUT)
    reply = chained.result(timeout=TIMEOUT)
    assert not reply.stale and reply.bonus_token == want[4] and reply.length == length + 4


def overtaken(verifier: RemoteVerifier) -> RemoteVerifier:
    """Each round's own call held back until the chained call after it is sent (at most ``HOLD_S``: a round that
    sends none is merely slower), so that chained calls are sent in every round that may, and reach the server
    before the round they follow."""
    verify, verify_after, sent = verifier.verify, verifier.verify_after, threading.Event()

    def held(tree, **kw):
        sent.wait(HOLD_S)
        sent.clear()
        return verify(tree, **kw)

    def after(*args, **kw):
        pending = verify_after(*args, **kw)
        sent.set()
        return pending

    verifier.verify, verifier.verify_after = held, after
    return verifier


def run(tiny_server, d, chain: bool, sampling: SamplingParams = SamplingParams(), held: bool = True):
    verifier = RemoteVerifier(tiny_server[0], drafter=d)
    try:
        verifier = overtaken(verifier) if held else verifier
        return generate(
            verifier, d, PROMPT, NEW,
            Settings(sampling=sampling, max_tree_nodes=8, pipeline=True, chain=chain),
        )
    finally:
        verifier.shutdown()


@pytest.mark.parametrize("kind", ["model", "moa-tli1"])
def test_chained_rounds_give_the_plain_tokens(tiny_target, tiny_server, twin, plain, kind):
    gen = run(tiny_server, drafter(tiny_target, twin, kind), chain=True)
    assert gen.token_ids == plain and all(gen.verified)
    s = gen.stats
    assert s.chained > 0 and 0 <= s.chained_held <= s.chained
    if kind == "model":  # always right: the chained round is the next one, save where the generation ends
        assert s.chained_held >= s.chained - 1 and s.chained_held >= s.rounds // 2


def test_sampled_chained_rounds_verify_the_trees_unchained_rounds_do(tiny_target, tiny_server, twin):
    """The server's samples follow the trees it verifies and a stale call computes nothing: chained and unchained
    pipelining verify the same trees in the same order (StaticPolicy), so they give the same tokens for a seed."""
    for seed in range(3):
        sampling = SamplingParams(temperature=0.8, seed=seed)
        chained = run(tiny_server, drafter(tiny_target, twin, "moa-tli1"), True, sampling)
        unchained = run(tiny_server, drafter(tiny_target, twin, "moa-tli1"), False, sampling, held=False)
        assert chained.token_ids == unchained.token_ids
        assert chained.stats.chained > 0 and chained.stats.tree_nodes == unchained.stats.tree_nodes
