"""Streams (Decode): the server decodes a session by itself; lossless across every switch."""

from __future__ import annotations

import contextlib
import threading
import time

import grpc
import pytest

from client.drafters.base import NoDrafter
from client.drafters.moa import MoADrafter
from client.loop import stretch
from client.loop.adaptive import AdaptivePolicy
from client.loop.decode import Settings, generate
from client.loop.offline import Backoff, Resilience
from client.loop.schedule import PAUSE
from client.net.remote import RemoteVerifier
from client.verifiers import LocalVerifier
from netsim import simulated_link
from shared.acceptance import SamplingParams
from shared.payload import PayloadSpec
from shared.tree import DraftTree
from shared.wire import splitspec_pb2 as pb
from shared.wire import splitspec_pb2_grpc as pb_grpc
from tests.conftest import own_server, served, wait_until
from tests.test_moa import make_moa

PROMPT = [5, 9, 14, 5, 9, 21, 33, 40, 41, 5, 9]
NEW = 60


server = pytest.fixture(scope="module", name="server")(own_server)


@pytest.fixture(scope="module")
def plain(tiny_target):
    return generate(LocalVerifier(tiny_target), NoDrafter(), PROMPT, NEW, Settings(stop_ids=[])).token_ids


def moa(tiny_target):
    return MoADrafter(make_moa(tiny_target, 1), width=3, depth=3)


@contextlib.contextmanager
def remote(address, **kw):
    verifier = RemoteVerifier(address, **kw)
    try:
        yield verifier
    finally:
        verifier.shutdown()


@pytest.mark.parametrize("mode", ["stream", "auto"])
def test_streamed_and_switching_generations_equal_plain_decoding(tiny_target, server, plain, mode):
    with remote(server[0]) as verifier:
        policy = AdaptivePolicy.for_run(verifier, [PayloadSpec("kv", "fp16")], mode=mode)
        gen = generate(verifier, moa(tiny_target), PROMPT, NEW, Settings(stop_ids=[], policy=policy))
    s = gen.stats
    assert gen.token_ids == plain and all(gen.verified)
    # the first stretch opened the session (the prefill's token is its first): no OpenSession, and the close is
    # sent without waiting for its answer; the prompt's features came with the first payload, not ahead of a token
    assert s.prefill_payload_bytes > 0
    if mode == "stream":
        assert s.streamed_tokens == NEW and s.rounds == 0 and s.streams == 1 and s.server_calls == 2
    else:  # a random drafter's rehearsals during the stream say drafting would not pay: it is never tried
        assert s.streamed_tokens == NEW and s.rounds == 0 and len(policy.schedule.rehearsals) >= 3
        assert all(path == [] for _, path, _, _ in policy.schedule.rehearsals)
        assert s.rehearse_s > 0 and s.draft_s == 0  # the client's drafting is counted though no tree was sent


class Oracle(NoDrafter):
    """Drafts what plain decoding will say: every draft accepted."""

    name = "oracle"

    def __init__(self, plain: list[int]):
        self.plain = plain

    def begin(self, tokens, features=None):
        self.at = len(tokens) - 1 - len(PROMPT)  # the root's index in the output

    def absorb(self, tokens, features=None):
        self.at += len(tokens)

    def rewind(self, n):
        self.at -= n

    def propose(self, max_nodes, depth=None):
        tree = DraftTree.chain(self.plain[self.at + 1 : self.at + 1 + min(max_nodes, depth or 4)])
        tree.scores = [0.0] * len(tree)
        return tree


def test_auto_drafts_once_its_rehearsals_say_drafting_pays(tiny_target, server, plain):
    """Rehearsals of a drafter that is always right predict more tokens a round than the stream gives: auto tries
    drafting after its first stretch, and both modes make the answer, exactly. (Its trees are 12 deep, so that a
    round gains 13 tokens: at the default depth of 3 a round trip measured on a loaded machine could make a 4-token
    round lose to the stream, rightly.)"""
    with remote(server[0]) as verifier:
        policy = AdaptivePolicy.for_run(verifier, [], mode="auto", pin_depth=12)
        gen = generate(verifier, Oracle(plain), PROMPT, NEW, Settings(stop_ids=[], policy=policy))
    s = gen.stats
    assert gen.token_ids == plain and s.streamed_tokens >= PAUSE and s.rounds >= 1
    assert s.streamed_tokens + round(s.acceptance_length * s.rounds) >= NEW  # (the last round may overshoot)
    assert all(len(path) == nodes for nodes, path, _, _ in policy.schedule.rehearsals)


def test_a_stretch_that_ends_between_two_payloads_reads_on_to_the_next(tiny_target, server, plain):
    """Payloads come every 8 tokens: a 3-token stretch goes on to the 8th, so the drafter has every feature when
    drafting resumes (it refuses a gap)."""
    with remote(server[0]) as verifier:
        policy = AdaptivePolicy.for_run(verifier, [PayloadSpec("kv", "fp16")], mode="auto")
        policy.schedule.left = 3
        gen = generate(verifier, moa(tiny_target), PROMPT, NEW, Settings(stop_ids=[], policy=policy))
    assert gen.token_ids == plain and gen.stats.rounds >= 1
    assert gen.stats.streamed_tokens >= 8  # the first stretch read on to its payload


def test_in_process_the_same_loop_streams_plain_steps(tiny_target, plain):
    policy = AdaptivePolicy.for_run(LocalVerifier(tiny_target), [], mode="stream")
    gen = generate(
        LocalVerifier(tiny_target), NoDrafter(), PROMPT, NEW,
        Settings(stop_ids=[], policy=policy),
    )
    assert gen.token_ids == plain and gen.stats.streamed_tokens == NEW


def test_a_stream_closed_early_ends_exactly_whatever_the_server_decoded_past_it(tiny_target, server, plain):
    """The server may decode past what the client took (its thread goes on until the next call comes); the next
    Verify takes those tokens first or verifies its tree itself: the same answer either way."""
    with remote(server[0]) as verifier:
        verifier.open(PROMPT, SamplingParams())
        stream = verifier.decode(40, [])
        got = [next(stream).new_tokens[0] for _ in range(3)]
        stream.close()
        assert verifier.length == len(PROMPT) + 4
        nxt = verifier.verify(DraftTree.chain(plain[4:9]))  # a draft that is right: all of it accepted
        assert got == plain[1:4] and len(nxt.accepted) == 5 and nxt.new_tokens == plain[4:10]
        verifier.close()


def test_a_stream_its_client_left_decodes_on_and_the_next_calls_take_its_tokens_without_a_forward(server, plain):
    """A cut mid-stream costs the server no work: it decodes the call's budget on, and the client's next calls
    take those tokens first — a tree's nodes that spell them are accepted with no forward, the first held token
    they miss is the bonus, a Decode streams them — before anything is computed again."""
    address, service = server
    with remote(address) as verifier:
        verifier.open(PROMPT, SamplingParams())
        stream = verifier.decode(12, [])
        got = [next(stream).new_tokens[0] for _ in range(3)]
        stream.close()
        session = service.sessions.get(verifier.session_id)
        wait_until(lambda: len(session.sequence.tokens) == len(PROMPT) + 13 and not session.lock.locked())
        decoded, nodes = session.stats.decoded, session.stats.nodes

        right = verifier.verify(DraftTree.chain(plain[4:7]))  # all three held: accepted, the fourth is the bonus
        assert got == plain[1:4] and right.accepted == [0, 1, 2] and right.new_tokens == plain[4:8]
        wrong = verifier.verify(DraftTree([plain[8], plain[8] + 1, plain[9]], [-1, 0, -1]))
        assert wrong.accepted == [0] and wrong.new_tokens == plain[8:10]  # the held token it missed is the bonus
        assert session.stats.nodes == nodes and verifier.length == len(PROMPT) + 10

        chunks = list(verifier.decode(5, []))  # the three still held first, with no compute, then two decoded
        assert [c.new_tokens[0] for c in chunks] == plain[10:15]
        assert [c.compute_s for c in chunks[:3]] == [0.0, 0.0, 0.0] and session.stats.decoded == decoded + 2
        past = verifier.verify(DraftTree.chain(plain[15:18]))  # nothing held now: a forward as ever
        assert past.new_tokens == plain[15:19] and session.stats.nodes == nodes + 3
        verifier.close()


def test_a_stream_decodes_on_for_a_client_gone_only_keep_decoding_tokens(tiny_target):
    """Bounded: once its client is gone, a stream stops after ``keep_decoding`` tokens however large its budget."""

    class Context:
        active = True

        def is_active(self) -> bool:
            return self.active

    with served(tiny_target, keep_decoding=5) as (address, service):
        with remote(address) as verifier:
            verifier.open(PROMPT, SamplingParams())
            session, context = service.sessions.get(verifier.session_id), Context()
            request = pb.DecodeRequest(session_id=verifier.session_id, length=verifier.length, max_new_tokens=60)
            chunks = service.stretches.steps(session, request, PayloadSpec(), set(), [], (None, 0.0), context)
            taken = [next(chunks).token for _ in range(4)]
            context.active = False
            rest = [c.token for c in chunks]  # what it went on to decode: the stream's own thread drops these
            assert taken + rest == plain_of(tiny_target, 9) and len(session.sequence.tokens) == len(PROMPT) + 10

            verifier.close()  # a session closed meanwhile: nothing more is decoded for it
            chunks = service.stretches.steps(session, request, PayloadSpec(), set(), [], (None, 0.0), context)
            assert [c.token for c in chunks] == []


def test_a_verify_whose_client_left_decodes_on_and_the_next_call_takes_its_tokens(tiny_target, plain):
    """A cut while a drafted round is verified: the server decodes on after it (``keep_decoding`` tokens here), and the
    client's settlement, sent after the length it had, takes the round's and those tokens with no forward."""
    with served(tiny_target, keep_decoding=6) as (address, service):
        with remote(address) as verifier:
            verifier.open(PROMPT, SamplingParams())
            session = service.sessions.get(verifier.session_id)

            class Gone:  # the client is there until the round has committed its tokens, then gone
                def is_active(self) -> bool:
                    return session.verified is None

                def auth_context(self) -> dict:  # no TLS: no certificate names
                    return {}

            lost = pb.VerifyRequest(session_id=verifier.session_id, tokens=plain[1:3], parents=[-1, 0],
                                    length=verifier.length)  # fmt: skip
            assert service.Verify(lost, Gone()).length == len(PROMPT) + 4  # a reply nobody reads
            wait_until(lambda: len(session.sequence.tokens) == len(PROMPT) + 10 and not session.lock.locked())
            nodes = session.stats.nodes
            settled = verifier.verify(DraftTree.chain(plain[1:9]))  # sent after the length the client still has
            assert settled.new_tokens == plain[1:10] and session.stats.nodes == nodes
            assert verifier.verify(DraftTree.chain(plain[10:12])).new_tokens == plain[10:13]


def plain_of(target, n: int) -> list[int]:
    return generate(LocalVerifier(target), NoDrafter(), PROMPT, n + 1, Settings(stop_ids=[])).token_ids[1:]


@pytest.mark.parametrize("kind", ["moa", "eagle"])
def test_a_cut_mid_stream_goes_offline_from_the_last_token_and_ends_exactly(tiny_target, server, netsim_server, plain,
                                                                          kind):  # fmt: skip
    from tests.test_eagle_independent import make_drafter, make_model

    drafter = moa(tiny_target) if kind == "moa" else make_drafter(make_model(tiny_target, "eagle"), width=3, depth=3)
    spec = PayloadSpec("kv" if kind == "moa" else "hidden", "fp16")
    with simulated_link(server[0], "none", netsim=netsim_server) as link, remote(link.address) as verifier:
        cut, fetched = [], []
        fetch = verifier.fetch
        verifier.fetch = lambda a, b, spec: fetched.append((a, b)) or fetch(a, b, spec)

        def update(tokens, verified):
            if len(tokens) >= 13 and not cut:  # between two payloads (every 8 tokens)
                cut.append(len(tokens))
                link.cut()
                threading.Timer(0.5, link.restore).start()

        policy = AdaptivePolicy.for_run(verifier, [spec], mode="stream")
        gen = generate(
            verifier, drafter, PROMPT, NEW,
            Settings(
                stop_ids=[],
                policy=policy,
                resilience=Resilience("verify", Backoff(base_s=0.02, cap_s=0.2, seed=1)),
                spec=spec,
            ),
            on_update=update,
        )  # fmt: skip
    s = gen.stats
    assert gen.token_ids == plain and all(gen.verified)
    assert s.disconnects >= 1 and s.offline_tokens >= 1 and s.streams >= 2  # streamed again after the cut
    assert s.streamed_tokens >= cut[0] - 1
    # the features of the tokens streamed since the last payload were fetched when the server was back
    assert fetched and all(0 < b - a < 8 for a, b in fetched) and fetched[0][1] >= len(PROMPT) + cut[0] - 1


def test_a_cut_before_the_prompts_features_arrived_waits_for_the_server_and_ends_exactly(
        tiny_target, server, netsim_server, plain, monkeypatch):  # fmt: skip
    """The stream that opened the session sends the prompt's features with its first payload: cut before it (no
    payload for 200 tokens here), the drafter has nothing to generate from, so the client waits, fetches them
    all when the server is back, and goes on."""
    monkeypatch.setattr(stretch, "PAYLOAD_EVERY", 200)
    with simulated_link(server[0], "none", netsim=netsim_server) as link, remote(link.address) as verifier:
        fetched, fetch, cut = [], verifier.fetch, []
        verifier.fetch = lambda a, b, spec: fetched.append((a, b)) or fetch(a, b, spec)

        def update(tokens, verified):
            if len(tokens) == 5 and not cut:
                cut.append(len(tokens))
                link.cut()
                threading.Timer(0.5, link.restore).start()

        policy = AdaptivePolicy.for_run(verifier, [PayloadSpec("kv", "fp16")], mode="stream")
        gen = generate(
            verifier, moa(tiny_target), PROMPT, NEW,
            Settings(
                stop_ids=[],
                policy=policy,
                resilience=Resilience("verify", Backoff(base_s=0.02, cap_s=0.2, seed=1)),
            ),
            on_update=update,
        )  # fmt: skip
    s = gen.stats
    assert gen.token_ids == plain and all(gen.verified)
    assert s.disconnects >= 1 and s.offline_tokens == 0 and fetched[0][0] == 0 and fetched[0][1] >= len(PROMPT) + 4


def test_decode_refuses_bad_requests_with_a_clear_status(server):
    channel = grpc.insecure_channel(server[0])
    stub = pb_grpc.SplitSpecStub(channel)
    try:
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Decode(pb.DecodeRequest(session_id="nope", max_new_tokens=4), timeout=10))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        opened = stub.OpenSession(pb.OpenSessionRequest(prompt_ids=PROMPT), timeout=10)
        for request, fragment in [(pb.DecodeRequest(session_id=opened.session_id), "max_new_tokens 0"),
                                  (pb.DecodeRequest(session_id=opened.session_id, max_new_tokens=2,
                                                    stop_token_ids=[10**6]), "stop token id 1000000")]:  # fmt: skip
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Decode(request, timeout=10))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and fragment in err.value.details()
        # the refusals left the session as it was: it decodes on from the prompt
        chunks = list(stub.Decode(pb.DecodeRequest(session_id=opened.session_id, length=opened.length,
                                                   max_new_tokens=3), timeout=10))  # fmt: skip
        assert [c.length for c in chunks] == [opened.length + i for i in (1, 2, 3)]
        assert chunks[-1].finish_reason == "length" and all(c.load.prefer == "latency" for c in chunks)
        # a Decode that opens its session takes no session of its own
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Decode(pb.DecodeRequest(session_id=opened.session_id, prompt_ids=PROMPT, max_new_tokens=2)))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "takes no session_id" in err.value.details()
    finally:
        channel.close()


def test_a_decode_that_opens_its_session_sends_the_first_token_before_the_prompts_features(server, plain):
    channel = grpc.insecure_channel(server[0])
    stub = pb_grpc.SplitSpecStub(channel)
    try:
        spec = PayloadSpec("kv", "fp16").to_msg()
        chunks = list(stub.Decode(pb.DecodeRequest(prompt_ids=PROMPT, max_new_tokens=4, payload=spec,
                                                   payload_every=2), timeout=10))  # fmt: skip
        assert [c.token for c in chunks] == plain[:4] and chunks[0].session_id and not chunks[1].session_id
        assert [c.length for c in chunks] == [len(PROMPT) + i for i in (1, 2, 3, 4)]
        # the first chunk is the prefill's token alone; the second brings the prompt's features and its own
        assert not chunks[0].HasField("payload")
        assert (chunks[1].payload.start, chunks[1].payload.count) == (0, len(PROMPT) + 1)
        stub.CloseSession(pb.CloseSessionRequest(session_id=chunks[0].session_id), timeout=10)
    finally:
        channel.close()


def test_a_server_that_prefers_capacity_says_so_in_every_reply(tiny_target):
    from server.limits import ServerLimits
    from server.service import build_server

    srv, port, _ = build_server(tiny_target, "127.0.0.1", 0, ServerLimits(max_context=128), prefer="capacity")
    srv.start()
    try:
        with remote(f"127.0.0.1:{port}") as verifier:
            opened = verifier.open(PROMPT, SamplingParams())
            assert opened.load.prefer == "capacity" and opened.load.sessions >= 1
            assert verifier.verify(DraftTree()).load.prefer == "capacity"
            assert next(verifier.decode(1, [])).load.prefer == "capacity"
    finally:
        srv.stop(grace=None)


def cut_run(tiny_target, server, netsim_server, resilience, down_s: float = 0.8):
    """A streamed generation whose link is cut after 13 tokens for ``down_s``."""
    drafter = moa(tiny_target)
    with simulated_link(server[0], "none", netsim=netsim_server) as link, remote(link.address) as verifier:
        cut = []

        def update(tokens, verified):
            if len(tokens) >= 13 and not cut:
                cut.append(1)
                link.cut()
                threading.Timer(down_s, link.restore).start()

        policy = AdaptivePolicy.for_run(verifier, [PayloadSpec("kv", "fp16")], mode="stream")
        return generate(
            verifier, drafter, PROMPT, NEW,
            Settings(stop_ids=[], policy=policy, resilience=resilience),
            on_update=update,
        )  # fmt: skip


def test_offline_generation_waits_once_its_tokens_would_almost_surely_be_discarded(tiny_target, server, netsim_server,
                                                                                 plain):  # fmt: skip
    """A random drafter is unsure of every token: the chance that all its offline tokens survive verification soon
    falls below the cap, and it stops making them; without the cap it goes on for the whole cut."""
    backoff = Backoff(base_s=0.02, cap_s=0.2, seed=1)
    capped = cut_run(tiny_target, server, netsim_server, Resilience("verify", backoff, offline_cap=0.05))
    free = cut_run(tiny_target, server, netsim_server, Resilience("verify", backoff, offline_cap=0.0))
    for gen in (capped, free):
        assert gen.token_ids == plain and all(gen.verified)
    assert capped.stats.offline_capped == 1 and free.stats.offline_capped == 0
    assert 1 <= capped.stats.offline_tokens < free.stats.offline_tokens
    assert capped.stats.offline_kept <= capped.stats.offline_tokens


def test_a_cut_longer_than_keep_after_keeps_the_offline_text(tiny_target, server, netsim_server, plain):
    backoff = Backoff(base_s=0.02, cap_s=0.2, seed=1)
    gen = cut_run(tiny_target, server, netsim_server, Resilience("verify", backoff, keep_after_s=0.2))
    s = gen.stats
    assert s.offline_tokens >= 1 and s.offline_kept == s.offline_tokens  # the cap waits only until keep_after
    assert gen.verified.count(False) == s.offline_tokens and gen.token_ids[:13] == plain[:13]
    with pytest.raises(ValueError, match="keep_after_s must be >= 0"):
        Resilience(keep_after_s=-1.0)


def test_a_probe_queued_behind_a_stream_is_not_a_cut(server):
    """A probe unanswered while the server's stream kept arriving (a congested slow link) does not mark the link
    dead; one unanswered with nothing heard since it was sent does. The reply in flight's transfer time extends a
    probe's deadline."""
    from client.net.endpoint import Endpoint
    from client.net.heartbeat import Heartbeat
    from client.net.link import LinkMonitor

    class Failed:
        def cancelled(self):
            return False

        def exception(self):
            error = grpc.RpcError()
            error.code = lambda: grpc.StatusCode.DEADLINE_EXCEEDED
            return error

    heard = [0.0]
    beat = Heartbeat(Endpoint(server[0]), LinkMonitor(), heard=lambda: heard[0], backlog_s=lambda: 0.25)
    try:
        assert beat.deadline_s() >= 0.25
        sent = time.monotonic()
        heard[0] = sent + 0.2  # a chunk of the stream arrived after the probe went out
        beat._pending[first := Failed()] = (sent, 0.1, beat.generation)  # out, as ``_probe`` sends one
        beat._answered(first, 0.1, beat.generation, sent)
        assert not beat.dead.is_set()
        heard[0] = sent - 1.0  # nothing since
        beat._pending[second := Failed()] = (sent, 0.1, beat.generation)
        beat._answered(second, 0.1, beat.generation, sent)
        assert beat.dead.is_set()
    finally:
        beat.close()


def test_no_probe_goes_out_while_the_stream_is_heard_from(server):
    """A stream's chunks arriving say the link is up: the heartbeat stays quiet, and probes once they stop. The
    heartbeat's clock is the test's: the link is quiet exactly when the test moves it on past the last chunk."""
    from client.net.endpoint import Endpoint
    from client.net.heartbeat import Heartbeat
    from client.net.link import LinkMonitor

    now, turns = [100.0], [0]  # a chunk was heard at 100.0 (``heard``), and the clock stands there

    def busy() -> bool:  # asked once a turn of the heartbeat's loop
        turns[0] += 1
        return True

    beat = Heartbeat(Endpoint(server[0]), LinkMonitor(), busy=busy, heard=lambda: 100.0,
                     clock=lambda: now[0]).start()  # fmt: skip
    try:
        assert beat.quiet() is False
        wait_until(lambda: turns[0] >= 5)  # several turns, each heard from within the interval
        assert beat.probes == 0
        now[0] += beat.interval_s()  # the stream stopped an interval ago
        assert beat.quiet() is True
        wait_until(lambda: beat.probes >= 2)
        assert not beat.dead.is_set()
    finally:
        beat.close()


def test_a_probe_grpc_never_ends_is_counted_unanswered_once_its_deadline_and_grace_pass(server):
    """``_overdue`` on the heartbeat's clock: a probe out for its deadline plus ``GRACE_S`` marks the link dead, one
    a moment short of that does not, whatever the wall clock did meanwhile."""
    from client.net.deadlines import GRACE_S
    from client.net.endpoint import Endpoint
    from client.net.heartbeat import Heartbeat
    from client.net.link import LinkMonitor

    class Stuck:  # a probe whose callback never comes
        def cancel(self):
            pass

    now = [50.0]
    beat = Heartbeat(Endpoint(server[0]), LinkMonitor(), clock=lambda: now[0])
    try:
        beat._pending[stuck := Stuck()] = (50.0, 0.2, beat.generation)  # sent at 50.0 with a 0.2 s deadline
        now[0] = 50.0 + 0.2 + GRACE_S - 0.01
        beat._overdue()
        assert not beat.dead.is_set() and stuck in beat._pending
        now[0] = 50.0 + 0.2 + GRACE_S + 0.01
        beat._overdue()
        assert beat.dead.is_set() and "no end from gRPC" in beat.reason and stuck not in beat._pending
    finally:
        beat.close()


def test_the_servers_own_lookup_decodes_several_tokens_a_step_exactly(server, plain):
    """With ``lookup`` the server verifies its own prompt-lookup drafts: the tiny model's answer loops, so steps
    yield several tokens (the later ones carry no compute of their own), and the answer is plain decoding's. A stop
    token inside an accepted draft ends it there, and the session holds exactly what was sent."""
    channel = grpc.insecure_channel(server[0])
    stub = pb_grpc.SplitSpecStub(channel)
    never = next(t for t in range(1000) if t not in plain)
    try:
        chunks = list(stub.Decode(pb.DecodeRequest(prompt_ids=PROMPT, max_new_tokens=NEW, self_draft=8,
                                                   stop_token_ids=[never]), timeout=30))  # fmt: skip
        assert [c.token for c in chunks] == plain
        assert [c.length for c in chunks] == [len(PROMPT) + i for i in range(1, NEW + 1)]
        assert sum(c.compute_s == 0 for c in chunks) > 0  # tokens that rode on another token's step
        stub.CloseSession(pb.CloseSessionRequest(session_id=chunks[0].session_id), timeout=10)
        stop = plain[-10]
        end = plain.index(stop) + 1
        chunks = list(stub.Decode(pb.DecodeRequest(prompt_ids=PROMPT, max_new_tokens=NEW, self_draft=8,
                                                   stop_token_ids=[stop]), timeout=30))  # fmt: skip
        assert [c.token for c in chunks] == plain[:end] and chunks[-1].finish_reason == "stop"
        more = list(stub.Decode(pb.DecodeRequest(session_id=chunks[0].session_id, length=chunks[-1].length,
                                                 max_new_tokens=5, stop_token_ids=[never]), timeout=30))  # fmt: skip
        assert [c.token for c in more] == plain[end : end + 5]
    finally:
        channel.close()
