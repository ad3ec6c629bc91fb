"""The gRPC server under bad input: every refusal is a clear status naming the problem, and nothing else breaks.

Bad requests are sent while other sessions decode on the same server. Every session here is mirrored by a
local ``TargetSession`` fed the very same trees, and the greedy "witness" must also equal a plain greedy decode
on ``tiny_target``, token for token: a refused request must not touch any cache, its own session's included.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest

from server.service import PROTOCOL_VERSION, Abort, SplitSpecService
from shared.acceptance import SamplingParams
from shared.engine.target import Target
from shared.tree import DraftTree
from shared.wire import splitspec_pb2 as pb
from shared.wire import splitspec_pb2_grpc as pb_grpc
from tests.conftest import start_server

TIMEOUT = 30.0
Code = grpc.StatusCode
GREEDY = pb.Sampling()
SAMPLED = pb.Sampling(temperature=2.0, top_p=0.95, seed=1234)  # hot enough that the tiny model's tokens vary
WITNESS_PROMPT = [1, 3, 100, 7, 200, 13, 42]
VICTIM_PROMPT = [1, 3, 50, 60, 70]
MAX_CONTEXT = 128  # tiny_server's limits
MAX_TREE_NODES = 16


def sampling_params(msg: pb.Sampling) -> SamplingParams:
    """What the server makes of a Sampling message (float32 fields, top_p 0 read as 1)."""
    return SamplingParams(temperature=msg.temperature, top_p=msg.top_p or 1.0, seed=msg.seed)


def reference(target: Target, prompt: list[int], sampling: pb.Sampling, n: int) -> list[int]:
    """Plain decoding on the target itself (prefill, then empty trees): the ``n`` tokens after the prompt."""
    session = target.session(sampling_params(sampling))
    session.prefill(prompt)
    while len(session.tokens) < len(prompt) + n:
        session.verify(DraftTree())
    return session.tokens[len(prompt) : len(prompt) + n]


def refused(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


class Seq:
    """A server session mirrored by a local TargetSession: every Verify must give the mirror's verdict."""

    def __init__(self, stub, target: Target, prompt: list[int], sampling: pb.Sampling, guide: list[int] | None = None):
        reply = stub.OpenSession(pb.OpenSessionRequest(prompt_ids=prompt, sampling=sampling), timeout=TIMEOUT)
        self.stub, self.id, self.vocab, self.guide = stub, reply.session_id, target.vocab_size, guide
        self.tokens = [*prompt, reply.first_token]
        self.mirror = target.session(sampling_params(sampling))
        self.mirror.prefill(prompt)
        self.steps, self.closed = 0, False
        assert reply.length == len(self.tokens)
        assert self.tokens == self.mirror.tokens

    def request(self, tree: DraftTree, **fields) -> pb.VerifyRequest:
        fields = {"session_id": self.id, "length": len(self.tokens), **fields}
        return pb.VerifyRequest(tokens=tree.tokens, parents=tree.parents, **fields)

    def next_tree(self) -> DraftTree:
        """Cycle plain decoding, a chain, and branchy trees whose accepted path is not contiguous (KV moves)."""
        n = len(self.tokens)
        g = self.guide[n : n + 3] if self.guide else [self.tokens[-1]] * 3  # likely continuations
        w = (g[0] + 1) % self.vocab  # a wrong sibling
        shapes = [
            DraftTree(),
            DraftTree.chain(g),
            DraftTree([w, g[0], g[1]], [-1, -1, 1]),
            DraftTree([g[0], w, g[1], g[2]], [-1, 0, 0, 2]),
        ]
        return shapes[self.steps % len(shapes)]

    def step(self, tree: DraftTree | None = None) -> None:
        tree = self.next_tree() if tree is None else tree
        reply = self.stub.Verify(self.request(tree), timeout=TIMEOUT)
        expected = self.mirror.verify(tree)
        assert (list(reply.accepted), reply.bonus_token) == (expected.accepted, expected.bonus)
        self.tokens += [tree.tokens[i] for i in reply.accepted] + [reply.bonus_token]
        assert reply.length == len(self.tokens) == len(self.mirror.tokens)
        self.steps += 1

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            reply = self.stub.CloseSession(pb.CloseSessionRequest(session_id=self.id), timeout=TIMEOUT)
            assert reply.length == len(self.tokens)


@pytest.fixture(scope="module")
def stub(tiny_server) -> Iterator[pb_grpc.SplitSpecStub]:
    address, _ = tiny_server
    with grpc.insecure_channel(address) as channel:
        yield pb_grpc.SplitSpecStub(channel)


@pytest.fixture(scope="module")
def witness_reference(tiny_target) -> list[int]:
    """The witness prompt plus its plain greedy continuation, long enough for every test below."""
    return [*WITNESS_PROMPT, *reference(tiny_target, WITNESS_PROMPT, GREEDY, 60)]


@pytest.fixture
def service(tiny_server) -> Iterator[SplitSpecService]:
    """tiny_server's service; the test must leave as many sessions open as it found (the server is shared)."""
    _, service = tiny_server
    before = len(service.sessions)
    yield service
    assert len(service.sessions) == before, "sessions leaked on the shared server"


@pytest.fixture
def open_seq(stub, tiny_target) -> Iterator[Callable[..., Seq]]:
    """Open mirrored sessions on tiny_server; whatever a test leaves open is closed afterwards."""
    opened: list[Seq] = []

    def open_(prompt: list[int], sampling: pb.Sampling = GREEDY, guide: list[int] | None = None) -> Seq:
        opened.append(Seq(stub, tiny_target, prompt, sampling, guide))
        return opened[-1]

    yield open_
    errors = []
    for seq in opened:  # close them all even if one fails, so no session outlives its test
        try:
            seq.close()
        except (AssertionError, grpc.RpcError) as exc:
            errors.append(exc)
    if errors:
        raise errors[0]


# --- bad requests: each is refused while a greedy witness and a sampled victim keep decoding --------------------


@dataclass
class Ctx:
    """What a bad request may use: the victim is the session that session-bound bad requests aim at."""

    stub: pb_grpc.SplitSpecStub
    victim: Seq
    service: SplitSpecService
    vocab: int

    def open(self, prompt: list[int], sampling: pb.Sampling = GREEDY) -> pb.OpenSessionReply:
        return self.stub.OpenSession(pb.OpenSessionRequest(prompt_ids=prompt, sampling=sampling), timeout=TIMEOUT)

    def generate(self, prompt: list[int], max_new_tokens: int = 4, sampling: pb.Sampling = GREEDY) -> list:
        request = pb.CompleteRequest(prompt_ids=prompt, sampling=sampling, max_new_tokens=max_new_tokens)
        return list(self.stub.Complete(request, timeout=TIMEOUT))

    def verify(self, tokens: list[int], parents: list[int], **fields) -> pb.VerifyReply:
        return self.stub.Verify(self.victim.request(DraftTree(tokens, parents), **fields), timeout=TIMEOUT)

    def close(self, session_id: str) -> pb.CloseSessionReply:
        return self.stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), timeout=TIMEOUT)


def verify_closed_session(c: Ctx) -> None:
    session_id = c.open([5, 6]).session_id
    c.close(session_id)
    c.stub.Verify(pb.VerifyRequest(session_id=session_id), timeout=TIMEOUT)


def close_twice(c: Ctx) -> None:
    session_id = c.open([5, 6]).session_id
    c.close(session_id)
    c.close(session_id)


def tree_beyond_context(c: Ctx) -> None:
    """121 committed tokens plus 8 drafted ones cannot fit 128, even though 8 nodes is within the node limit."""
    session_id = c.open([5] * (MAX_CONTEXT - 8)).session_id
    try:
        c.stub.Verify(pb.VerifyRequest(session_id=session_id, tokens=[5] * 8, parents=list(range(-1, 7))))
    finally:
        c.close(session_id)


def verify_busy_session(c: Ctx) -> None:
    """A second request on a session whose lock is held (a Verify in flight) is refused, not queued."""
    with c.service.sessions.get(c.victim.id).lock:
        c.verify([], [])


V = "{V}"  # the vocabulary size, filled in by the test
BAD_REQUESTS = [
    # prompts (OpenSession and Complete validate them alike)
    pytest.param(lambda c: c.open([5, 300]), Code.INVALID_ARGUMENT, "prompt token id 300 is outside the vocabulary",
                 id="open-prompt-token-oov"),
    pytest.param(lambda c: c.open([5, 2**32 - 1]), Code.INVALID_ARGUMENT, "prompt token id 4294967295 is outside",
                 id="open-prompt-token-uint32-max"),
    pytest.param(lambda c: c.open([5, c.vocab]), Code.INVALID_ARGUMENT,
                 f"prompt token id {V} is outside the vocabulary [0, {V})", id="open-prompt-token-equals-vocab"),
    pytest.param(lambda c: c.open([]), Code.INVALID_ARGUMENT, "empty prompt", id="open-empty-prompt"),
    pytest.param(lambda c: c.open([5] * MAX_CONTEXT), Code.INVALID_ARGUMENT,
                 f"prompt of {MAX_CONTEXT} tokens exceeds the context limit of {MAX_CONTEXT}",
                 id="open-prompt-too-long"),
    pytest.param(lambda c: c.stub.OpenSession(pb.OpenSessionRequest(prompt_ids=[5, 6], payload_from=3),
                                              timeout=TIMEOUT),
                 Code.INVALID_ARGUMENT, "payload_from 3 is past the prompt's 2 tokens", id="open-payload-from-past"),
    pytest.param(lambda c: list(c.stub.Decode(pb.DecodeRequest(prompt_ids=[5], max_new_tokens=2, payload_from=9),
                                              timeout=TIMEOUT)),
                 Code.INVALID_ARGUMENT, "payload_from 9 is past the prompt's 1 tokens", id="decode-payload-from-past"),
    pytest.param(lambda c: c.generate([5, 300]), Code.INVALID_ARGUMENT, "prompt token id 300 is outside",
                 id="generate-prompt-token-oov"),
    pytest.param(lambda c: c.generate([]), Code.INVALID_ARGUMENT, "empty prompt", id="generate-empty-prompt"),
    pytest.param(lambda c: c.generate([5] * 500), Code.INVALID_ARGUMENT, "prompt of 500 tokens exceeds the context",
                 id="generate-prompt-too-long"),
    # sampling
    pytest.param(lambda c: c.open([5], pb.Sampling(temperature=-1.0)), Code.INVALID_ARGUMENT,
                 "temperature -1.0 must be a finite number >= 0", id="open-negative-temperature"),
    pytest.param(lambda c: c.open([5], pb.Sampling(temperature=float("nan"))), Code.INVALID_ARGUMENT,
                 "temperature nan must be", id="open-nan-temperature"),
    pytest.param(lambda c: c.open([5], pb.Sampling(temperature=float("inf"))), Code.INVALID_ARGUMENT,
                 "temperature inf must be", id="open-infinite-temperature"),
    pytest.param(lambda c: c.open([5], pb.Sampling(temperature=1.0, top_p=1.5)), Code.INVALID_ARGUMENT,
                 "top_p 1.5 must be in (0, 1]", id="open-top-p-above-one"),
    pytest.param(lambda c: c.open([5], pb.Sampling(temperature=1.0, acceptance="medusa")), Code.INVALID_ARGUMENT,
                 "acceptance must be one of exact, typical, got 'medusa'", id="open-unknown-acceptance"),
    pytest.param(lambda c: c.open([5], pb.Sampling(temperature=1.0, acceptance="typical", epsilon=2.0)),
                 Code.INVALID_ARGUMENT, "epsilon must be in (0, 1], got 2.0", id="open-typical-epsilon-above-one"),
    pytest.param(lambda c: c.open([5], pb.Sampling(temperature=1.0, top_p=-0.5)), Code.INVALID_ARGUMENT,
                 "top_p -0.5 must be in (0, 1]", id="open-negative-top-p"),
    pytest.param(lambda c: c.generate([5], sampling=pb.Sampling(temperature=-2.0)), Code.INVALID_ARGUMENT,
                 "temperature -2.0 must be", id="generate-negative-temperature"),
    pytest.param(lambda c: c.generate([5], sampling=pb.Sampling(top_p=2.0)), Code.INVALID_ARGUMENT,
                 "top_p 2.0 must be in (0, 1]", id="generate-top-p-above-one"),
    # Complete's budget
    pytest.param(lambda c: c.generate([5], max_new_tokens=0), Code.INVALID_ARGUMENT,
                 "max_new_tokens 0 must be in [1, 4096]", id="generate-zero-new-tokens"),
    pytest.param(lambda c: c.generate([5], max_new_tokens=4097), Code.INVALID_ARGUMENT,
                 "max_new_tokens 4097 must be in [1, 4096]", id="generate-too-many-new-tokens"),
    # trees (aimed at the victim, which must stay usable)
    pytest.param(lambda c: c.verify([5, 300], [-1, 0]), Code.INVALID_ARGUMENT,
                 "token id 300 at node 1 is outside the vocabulary", id="tree-token-oov"),
    pytest.param(lambda c: c.verify([5, 6, c.vocab], [-1, 0, -1]), Code.INVALID_ARGUMENT,
                 f"token id {V} at node 2 is outside the vocabulary [0, {V})", id="tree-token-equals-vocab"),
    pytest.param(lambda c: c.verify([5, 6], [-1, 1]), Code.INVALID_ARGUMENT,
                 "parent index 1 of node 1 must be -1 (root) or a smaller node index", id="tree-parent-is-self"),
    pytest.param(lambda c: c.verify([5, 6, 7], [2, -1, 0]), Code.INVALID_ARGUMENT, "parent index 2 of node 0",
                 id="tree-parent-after-child"),
    pytest.param(lambda c: c.verify([5], [-2]), Code.INVALID_ARGUMENT, "parent index -2 of node 0",
                 id="tree-parent-below-root"),
    pytest.param(lambda c: c.verify([5, 6], [-1]), Code.INVALID_ARGUMENT, "tree has 2 tokens but 1 parent indices",
                 id="tree-count-mismatch"),
    pytest.param(lambda c: c.verify([5] * (MAX_TREE_NODES + 1), list(range(-1, MAX_TREE_NODES))),
                 Code.INVALID_ARGUMENT, f"tree has {MAX_TREE_NODES + 1} nodes, over the limit of {MAX_TREE_NODES}",
                 id="tree-over-node-limit"),
    pytest.param(tree_beyond_context, Code.OUT_OF_RANGE,
                 f"121 tokens plus a tree of 8 exceed the context limit of {MAX_CONTEXT}", id="tree-beyond-context"),
    # sessions
    pytest.param(lambda c: c.verify([], [], length=len(c.victim.tokens) + 1), Code.ABORTED,
                 "the server holds", id="verify-stale-length"),
    pytest.param(lambda c: c.verify([], [], session_id="no-such-session"), Code.NOT_FOUND,
                 "unknown or closed session 'no-such-session'", id="verify-unknown-session"),
    pytest.param(verify_closed_session, Code.NOT_FOUND, "unknown or closed session", id="verify-closed-session"),
    pytest.param(close_twice, Code.NOT_FOUND, "unknown or closed session", id="close-closed-session"),
    pytest.param(lambda c: c.close("no-such-session"), Code.NOT_FOUND, "unknown or closed session",
                 id="close-unknown-session"),
    pytest.param(verify_busy_session, Code.ABORTED, "is busy with another request", id="verify-busy-session"),
    # handshake
    pytest.param(lambda c: c.stub.Handshake(pb.HandshakeRequest(tokenizer_fingerprint="0123456789abcdef")),
                 Code.FAILED_PRECONDITION, "tokenizer fingerprint '0123456789abcdef' does not match",
                 id="handshake-wrong-fingerprint"),
]  # fmt: skip


@pytest.mark.parametrize(("bad", "code", "fragment"), BAD_REQUESTS)
def test_bad_request_is_refused_and_breaks_nothing(
    stub, tiny_target, service, open_seq, witness_reference, bad, code: grpc.StatusCode, fragment: str
):
    """The refusal names the problem; the witness, and the victim a session-bound request aimed at, decode on."""
    witness = open_seq(WITNESS_PROMPT, GREEDY, guide=witness_reference)
    victim = open_seq(VICTIM_PROMPT, SAMPLED)
    witness.step()
    victim.step()

    error = refused(lambda: bad(Ctx(stub, victim, service, tiny_target.vocab_size)))
    assert error.code() == code, error.details()
    assert fragment.format(V=tiny_target.vocab_size) in error.details()

    for _ in range(3):  # empty tree, chain, branchy trees: every shape after the refusal
        witness.step()
        victim.step()
    assert witness.tokens == witness_reference[: len(witness.tokens)]


def test_bad_trees_leave_the_session_usable(stub, service, open_seq, witness_reference):
    """Several refused trees in a row on one greedy session: the next good Verify still gives the greedy tokens."""
    seq = open_seq(WITNESS_PROMPT, GREEDY, guide=witness_reference)
    bad_trees = [([5, 300], [-1, 0]), ([5, 6], [-1, 1]), ([5] * (MAX_TREE_NODES + 1), list(range(-1, MAX_TREE_NODES)))]
    for tokens, parents in bad_trees:
        error = refused(lambda t=tokens, p=parents: stub.Verify(seq.request(DraftTree(t, p)), timeout=TIMEOUT))
        assert error.code() == Code.INVALID_ARGUMENT
        seq.step()
    assert seq.tokens == witness_reference[: len(seq.tokens)]


# --- the good paths ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("send_fingerprint", [False, True], ids=["no-fingerprint", "matching-fingerprint"])
def test_handshake_describes_the_target_and_limits(stub, tiny_target, send_fingerprint: bool):
    """The client learns everything it checks or sizes its drafts by from this one reply."""
    fingerprint = tiny_target.fingerprint if send_fingerprint else ""
    reply = stub.Handshake(pb.HandshakeRequest(client="test", tokenizer_fingerprint=fingerprint), timeout=TIMEOUT)
    t = tiny_target
    assert reply.protocol_version == PROTOCOL_VERSION
    assert reply.tokenizer_fingerprint == t.fingerprint != ""
    assert reply.model_name == t.name
    assert (reply.vocab_size, reply.num_layers, reply.hidden_size) == (t.vocab_size, t.num_layers, t.hidden_size)
    assert (reply.num_kv_heads, reply.head_dim) == (t.num_kv_heads, t.head_dim)
    assert list(reply.eos_token_ids) == t.eos_token_ids
    assert (reply.device, reply.dtype) == (str(t.device), str(t.dtype).removeprefix("torch."))
    lim = reply.limits
    assert (lim.max_sessions, lim.max_tree_nodes, lim.max_context) == (4, MAX_TREE_NODES, MAX_CONTEXT)
    assert lim.max_new_tokens == 4096 and lim.session_ttl_s == 600.0


def test_max_context_is_capped_by_the_target(tiny_target):
    """A server configured beyond the model's context advertises (and enforces) the model's."""
    server, address, _ = start_server(tiny_target, max_context=10 * tiny_target.max_context)
    try:
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.SplitSpecStub(channel)
            reply = stub.Handshake(pb.HandshakeRequest(), timeout=TIMEOUT)
            assert reply.limits.max_context == tiny_target.max_context
            prompt = [5] * tiny_target.max_context
            error = refused(lambda: stub.OpenSession(pb.OpenSessionRequest(prompt_ids=prompt), timeout=TIMEOUT))
            assert error.code() == Code.INVALID_ARGUMENT
            assert f"exceeds the context limit of {tiny_target.max_context}" in error.details()
    finally:
        server.stop(grace=None)


@pytest.mark.parametrize(
    ("prompt", "sampling", "max_new_tokens", "stop"),
    [
        pytest.param(WITNESS_PROMPT, GREEDY, 24, "absent", id="greedy"),
        pytest.param(WITNESS_PROMPT, SAMPLED, 24, "absent", id="sampled-by-seed"),
        pytest.param(WITNESS_PROMPT, SAMPLED, 24, "fifth", id="sampled-stop-token"),
        pytest.param([5, 9, 2], GREEDY, 24, "eos", id="greedy-default-eos"),
        pytest.param([7] * (MAX_CONTEXT - 8), GREEDY, 100, "absent", id="budget-capped-by-context"),
    ],
)
def test_generate_streams_the_reference_decode(
    stub, tiny_target, service, prompt: list[int], sampling: pb.Sampling, max_new_tokens: int, stop: str
):
    """One token per chunk, exactly the target's own decode; the last chunk says why it stopped."""
    budget = min(max_new_tokens, MAX_CONTEXT - len(prompt))
    continuation = reference(tiny_target, prompt, sampling, budget)
    stop_ids = {
        "absent": [next(t for t in range(tiny_target.vocab_size) if t not in continuation)],
        "fifth": [continuation[4]],
        "eos": [],
    }[stop]
    stop_set = set(stop_ids) or set(tiny_target.eos_token_ids)
    cut = next((i + 1 for i, t in enumerate(continuation) if t in stop_set), None)
    expected, reason = (continuation[:cut], "stop") if cut else (continuation, "length")

    request = pb.CompleteRequest(
        prompt_ids=prompt, sampling=sampling, max_new_tokens=max_new_tokens, stop_token_ids=stop_ids
    )
    chunks = list(stub.Complete(request, timeout=TIMEOUT))
    assert all(len(chunk.tokens) == 1 for chunk in chunks)
    assert [chunk.tokens[0] for chunk in chunks] == expected
    assert [chunk.finish_reason for chunk in chunks] == [""] * (len(chunks) - 1) + [reason]
    old = list(stub.Generate(request, timeout=TIMEOUT))  # the call's name before the rename answers the same
    assert [(c.tokens, c.finish_reason) for c in old] == [(c.tokens, c.finish_reason) for c in chunks]


def test_session_limit_and_close_frees_a_slot(tiny_target, witness_reference):
    """Past the limit OpenSession is RESOURCE_EXHAUSTED; closing one frees its slot; the others never notice."""
    server, address, service = start_server(tiny_target, max_sessions=2, max_tree_nodes=MAX_TREE_NODES)
    try:
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.SplitSpecStub(channel)
            witness = Seq(stub, tiny_target, WITNESS_PROMPT, GREEDY, guide=witness_reference)
            other = Seq(stub, tiny_target, VICTIM_PROMPT, SAMPLED)
            witness.step()
            for _ in range(2):  # refused twice: a refusal takes no slot
                request = pb.OpenSessionRequest(prompt_ids=[5, 6])
                error = refused(lambda r=request: stub.OpenSession(r, timeout=TIMEOUT))
                assert error.code() == Code.RESOURCE_EXHAUSTED
                assert "all 2 sessions are in use" in error.details()
                witness.step()
            assert len(service.sessions) == 2

            other.step()
            other.close()
            third = Seq(stub, tiny_target, VICTIM_PROMPT, SAMPLED)
            for _ in range(4):
                witness.step()
                third.step()
            assert witness.tokens == witness_reference[: len(witness.tokens)]
            witness.close()
            third.close()
            assert len(service.sessions) == 0
    finally:
        server.stop(grace=None)


def test_idle_sessions_expire_and_free_their_slot(tiny_target):
    """A session idle past the TTL is dropped: its slot is reused and its id is NOT_FOUND afterwards."""
    server, address, service = start_server(tiny_target, max_sessions=1, session_ttl_s=0.2)
    try:
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.SplitSpecStub(channel)
            idle = Seq(stub, tiny_target, [5, 6], GREEDY)
            idle.step()
            time.sleep(0.4)
            fresh = Seq(stub, tiny_target, VICTIM_PROMPT, GREEDY)  # only fits because the idle one expired
            error = refused(lambda: stub.Verify(idle.request(DraftTree()), timeout=TIMEOUT))
            assert error.code() == Code.NOT_FOUND
            fresh.step()
            fresh.close()
            assert len(service.sessions) == 0
    finally:
        server.stop(grace=None)


# --- known server bugs (strict: these start failing once fixed, then drop the marker) ----------------------------


def test_tiny_temperature_is_not_an_internal_error(stub, service):
    """A subnormal temperature is valid by the server's own check, so it must decode (or be refused), not crash."""
    request = pb.OpenSessionRequest(prompt_ids=[5, 6], sampling=pb.Sampling(temperature=1e-40))
    try:
        reply = stub.OpenSession(request, timeout=TIMEOUT)
    except grpc.RpcError as exc:
        assert exc.code() == Code.INVALID_ARGUMENT, f"{exc.code().name}: {exc.details()}"
    else:
        stub.CloseSession(pb.CloseSessionRequest(session_id=reply.session_id), timeout=TIMEOUT)


def test_a_session_never_holds_more_than_max_context_tokens(stub, service, open_seq):
    """max_context counts committed tokens (prompt included), as OpenSession and Complete enforce it."""
    seq = open_seq([5] * (MAX_CONTEXT - 2))
    seq.step(DraftTree())
    assert len(seq.tokens) == MAX_CONTEXT  # full
    try:
        reply = stub.Verify(seq.request(DraftTree()), timeout=TIMEOUT)
    except grpc.RpcError as exc:
        assert exc.code() == Code.OUT_OF_RANGE, exc.details()
    else:
        seq.tokens.append(reply.bonus_token)  # keep the teardown's length check in step with the server
        pytest.fail(f"the session grew to {reply.length} tokens, over max_context {MAX_CONTEXT}")


def test_a_verify_resent_after_a_lost_reply_rolls_the_session_back(stub, service, open_seq, witness_reference):
    """The client never saw a round's reply (a cut link): it sends the round again with its own, shorter length;
    the server drops what that round committed and answers as the first time."""
    seq = open_seq(WITNESS_PROMPT, GREEDY, guide=witness_reference)
    seq.step()
    n = len(seq.tokens)
    tree = DraftTree.chain(witness_reference[n : n + 3])
    first = stub.Verify(seq.request(tree), timeout=TIMEOUT)  # the reply "lost": seq.tokens stays at n
    again = stub.Verify(seq.request(tree), timeout=TIMEOUT)
    assert (list(again.accepted), again.bonus_token, again.length) == (
        list(first.accepted), first.bonus_token, first.length,
    )  # fmt: skip
    seq.tokens += [tree.tokens[i] for i in again.accepted] + [again.bonus_token]
    seq.mirror.verify(tree)
    seq.step()  # and the session goes on in step with its mirror
    assert seq.tokens == witness_reference[: len(seq.tokens)]


@pytest.mark.parametrize(("error", "code", "fragment"), [
    (RuntimeError("a bug"), Code.INTERNAL, "Decode failed: RuntimeError: a bug"),
    (Abort(Code.DATA_LOSS, "refused mid-stream"), Code.DATA_LOSS, "refused mid-stream"),
], ids=["unexpected-error", "abort"])  # fmt: skip
def test_a_failure_mid_stream_ends_the_call_with_its_status_and_breaks_nothing(
    stub, service, open_seq, witness_reference, monkeypatch, error: Exception, code: grpc.StatusCode, fragment: str
):
    """A reply stream runs after its RPC method has returned: a step failing after the first chunk still ends the
    call with the status every RPC gets (INTERNAL naming the call for a bug, an Abort's own code), and the other
    sessions decode on."""
    witness = open_seq(WITNESS_PROMPT, GREEDY, guide=witness_reference)
    witness.step()

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(service.stretches, "_step", fail)  # a Decode stream's steps after the first (its prefill's)
    chunks = []
    request = pb.DecodeRequest(prompt_ids=VICTIM_PROMPT, max_new_tokens=8)
    failure = refused(lambda: chunks.extend(stub.Decode(request, timeout=TIMEOUT)))
    assert failure.code() == code, failure.details()
    assert fragment in failure.details()
    assert len(chunks) == 1 and chunks[0].session_id  # the failure came mid-stream
    if code != Code.INTERNAL:  # an Abort leaves its session open (a bug's half-written session is dropped)
        stub.CloseSession(pb.CloseSessionRequest(session_id=chunks[0].session_id), timeout=TIMEOUT)

    for _ in range(3):
        witness.step()
    assert witness.tokens == witness_reference[: len(witness.tokens)]
