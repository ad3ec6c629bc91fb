"""What an outside tester found holding the server back, one test each: admission, eviction, reaping,
streams that starve the workers, refusals after a prefill, payload streams cut by a rollback, names
that reach the file system, echoed strings past gRPC's metadata limit, and logs full of tracebacks."""

from __future__ import annotations

import logging
import threading
import time

import grpc
import pytest

from server.service import MAX_DETAILS
from shared.acceptance import SamplingParams
from shared.bundles import SHIPPED
from shared.tree import DraftTree
from shared.wire import splitspec_pb2 as pb
from shared.wire import splitspec_pb2_grpc as pb_grpc
from tests.conftest import start_server
from tests.test_server import GREEDY, TIMEOUT, Seq, refused

Code = grpc.StatusCode


@pytest.fixture
def serve(tiny_target):
    """Start a server of its own with the given limits; yields (stub, service); stops it afterwards."""
    started = []

    def start(**limits):
        server, address, service = start_server(tiny_target, **{"max_tree_nodes": 16, **limits})
        channel = grpc.insecure_channel(address)
        started.append((server, channel, service))
        return pb_grpc.SplitSpecStub(channel), service

    yield start
    for server, channel, service in started:
        channel.close()
        server.stop(grace=None)
        service.sessions.close()


def test_abandoned_sessions_never_lock_a_new_client_out(serve, tiny_target):
    """Before: two sessions left open without CloseSession refused every new client for the whole TTL."""
    stub, service = serve(max_sessions=2, session_ttl_s=600, evict_idle_s=0.2)
    abandoned = [Seq(stub, tiny_target, [5, 6, 7], GREEDY), Seq(stub, tiny_target, [8, 9], GREEDY)]
    abandoned[1].step()  # the first one has been idle longest
    time.sleep(0.3)
    fresh = Seq(stub, tiny_target, [5, 9, 14], GREEDY)  # admitted: the longest-idle session made room
    assert refused(lambda: stub.Verify(abandoned[0].request(DraftTree()), timeout=TIMEOUT)).code() == Code.NOT_FOUND
    abandoned[1].step()  # the other one is still there
    fresh.step()
    assert service.sessions.evicted == 1


def test_a_full_server_refuses_with_a_retry_hint_when_nobody_is_idle(serve, tiny_target):
    stub, _ = serve(max_sessions=1, evict_idle_s=30)
    active = Seq(stub, tiny_target, [5, 6, 7], GREEDY)
    call = stub.OpenSession.with_call
    error = refused(lambda: call(pb.OpenSessionRequest(prompt_ids=[5, 6]), timeout=TIMEOUT))
    assert error.code() == Code.RESOURCE_EXHAUSTED and "retry in" in error.details()
    pushback = dict(error.trailing_metadata())["grpc-retry-pushback-ms"]
    assert 0 < int(pushback) <= 30_000
    active.step()


def test_a_kv_memory_budget_admits_by_bytes(serve, tiny_target):
    """The budget counts every session's KV cache as allocated; it admits what fits and evicts idle sessions."""
    stub, service = serve(max_sessions=64, kv_memory_mb=1, evict_idle_s=0.1)
    per_session = service.kv_bytes_per_token * 256  # a short prompt's cache (its initial capacity)
    fit = (2**20) // per_session
    assert fit >= 2
    sessions = [Seq(stub, tiny_target, [5, 6, i], GREEDY) for i in range(fit)]
    assert service.sessions.nbytes <= 2**20
    time.sleep(0.15)
    Seq(stub, tiny_target, [7, 8], GREEDY)  # over the budget unless an idle one is evicted
    assert service.sessions.evicted == 1 and len(service.sessions) == fit
    assert refused(lambda: stub.Verify(sessions[0].request(DraftTree()), timeout=TIMEOUT)).code() == Code.NOT_FOUND


def test_on_a_gpu_the_budget_is_what_the_device_has_free_and_a_refusal_says_both(serve, tiny_target, monkeypatch):
    """A target on a GPU: the KV budget is at most ``KV_SHARE`` of the device's free memory (read here through
    ``device_free_bytes``, which a CPU answers with None); a session that would not fit is refused
    RESOURCE_EXHAUSTED, naming what it asks for and what is free, and the sessions already open go on."""
    import server.service

    per_session = tiny_target.engine.new_cache(1).nbytes * 256  # a short prompt's cache (its initial capacity)
    room = int(2.5 * per_session / server.service.KV_SHARE)  # for two short sessions and a half
    monkeypatch.setattr(server.service, "device_free_bytes", lambda device: room)
    stub, service = serve(max_sessions=64, kv_memory_mb=4096, evict_idle_s=30)
    assert abs(service.sessions.max_bytes - 2.5 * per_session) <= 1
    first, second = (Seq(stub, tiny_target, [5, 6, i], GREEDY) for i in range(2))
    error = refused(lambda: stub.OpenSession(pb.OpenSessionRequest(prompt_ids=[7, 8]), timeout=TIMEOUT))
    assert error.code() == Code.RESOURCE_EXHAUSTED
    asks, left = f"{per_session / 2**20:.1f} MiB", f"{0.5 * per_session / 2**20:.1f} MiB"
    assert f"asks for {asks}" in error.details() and f"{left} of the budget" in error.details(), error.details()
    first.step()
    second.step()


def test_expired_sessions_are_reaped_on_time_not_on_the_next_request(serve, tiny_target):
    stub, service = serve(max_sessions=8, session_ttl_s=0.2)
    for i in range(3):
        Seq(stub, tiny_target, [5, 6, i], GREEDY)
    assert len(service.sessions) == 3
    deadline = time.monotonic() + 5
    while len(service.sessions) and time.monotonic() < deadline:
        time.sleep(0.05)  # no request reaches the server meanwhile
    assert len(service.sessions) == 0 and service.sessions.expired == 3


def test_open_streams_cannot_starve_the_other_calls(serve, tiny_target):
    """Before: 20 Complete streams (not counted as sessions) took every worker; Handshake, Probe and
    OpenSession timed out for everyone until they were cancelled.

    The streams are held in the model (every forward waits for ``gate``) while the other calls are made: each must be
    answered while the gate is still closed — a call that waited for a stream's worker or its place would wait for
    the gate, which opens only after them, and end DEADLINE_EXCEEDED instead."""
    stub, service = serve(max_sessions=3, max_context=256, max_new_tokens=200)
    gate, held, forward = threading.Event(), threading.Semaphore(0), service.batcher.run

    def gated(step):
        held.release()
        gate.wait(TIMEOUT * 4)  # (bounded: a failing test still ends)
        return forward(step)

    service.batcher.run = gated
    try:
        streams = [stub.Complete(pb.CompleteRequest(prompt_ids=[5, 6, 7], max_new_tokens=200, stop_token_ids=[0]),
                                 timeout=TIMEOUT * 4) for _ in range(3)]  # fmt: skip
        assert all(held.acquire(timeout=TIMEOUT) for _ in streams), "the streams did not all reach the model"
        stub.Handshake(pb.HandshakeRequest(), timeout=TIMEOUT)
        stub.Probe(pb.ProbeRequest(), timeout=TIMEOUT)
        error = refused(lambda: stub.OpenSession(pb.OpenSessionRequest(prompt_ids=[5, 6]), timeout=TIMEOUT))
        assert error.code() == Code.RESOURCE_EXHAUSTED  # streams count against the limit: refused, not queued
        request = pb.CompleteRequest(prompt_ids=[5], max_new_tokens=5)
        error = refused(lambda: next(stub.Complete(request, timeout=TIMEOUT)))
        assert error.code() == Code.RESOURCE_EXHAUSTED
        assert not gate.is_set()  # all of it answered while every stream was held in the model
    finally:
        gate.set()
        service.batcher.run = forward
    for stream in streams:
        stream.cancel()
    deadline = time.monotonic() + 10
    while service.sessions.nbytes and time.monotonic() < deadline:  # places freed when the streams end
        time.sleep(0.05)
    Seq(stub, tiny_target, [5, 6], GREEDY).step()


def test_refused_opens_pay_no_prefill(serve, tiny_target):
    """Before: concurrent OpenSessions all passed the count check, each paid a full prefill, and all but one
    were refused afterwards. Now the place is held from admission: the refused ones never prefill."""
    stub, service = serve(max_sessions=1)
    made = []
    session = service.target.session
    service.target.session = lambda *a, **k: made.append(1) or session(*a, **k)
    try:
        results = []

        def open_one():
            try:
                stub.OpenSession(pb.OpenSessionRequest(prompt_ids=list(range(5, 100))), timeout=TIMEOUT)
                results.append("ok")
            except grpc.RpcError as exc:
                results.append(exc.code())

        threads = [threading.Thread(target=open_one) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        service.target.session = session
    assert sorted(map(str, results)) == sorted(["ok"] + [str(Code.RESOURCE_EXHAUSTED)] * 3)
    assert len(made) == 1


def test_a_payload_stream_cut_by_a_rollback_fails_instead_of_ending_short(serve, monkeypatch):
    """Before: FetchPayload racing a rollback Verify ended OK with fewer tokens than asked for. Here the
    rollback lands right after the first chunk (what a Verify resent with a shorter length does)."""
    import server.service

    stub, service = serve(max_sessions=2, max_inline_payload_bytes=2048)
    kv = pb.PayloadSpec(form="kv", precision="fp32")
    prompt = list(range(5, 40))
    reply = stub.OpenSession(pb.OpenSessionRequest(prompt_ids=prompt, payload=kv), timeout=TIMEOUT)
    length = reply.length
    for _ in range(3):
        length = stub.Verify(pb.VerifyRequest(session_id=reply.session_id, length=length), timeout=TIMEOUT).length
    session = service.sessions.get(reply.session_id)
    end = session.sequence.cached_len
    export = server.service.payloads.export

    def export_then_roll_back(*args):
        msg = export(*args)
        if msg.start == 0:
            session.truncate(len(prompt) + 1)
        return msg

    monkeypatch.setattr(server.service.payloads, "export", export_then_roll_back)
    chunks = stub.FetchPayload(pb.FetchPayloadRequest(session_id=reply.session_id, start=0, end=end, spec=kv),
                               timeout=TIMEOUT)  # fmt: skip
    first = next(chunks)
    assert first.start == 0 and 0 < first.count < end
    error = refused(lambda: list(chunks))
    assert error.code() == Code.ABORTED and "rollback" in error.details()


def test_a_drafter_name_never_reaches_the_file_system_unchecked(serve):
    stub, _ = serve()
    for name in ("x" * 300, "../../etc", "a/b", ".hidden"):
        error = refused(lambda n=name: stub.Handshake(pb.HandshakeRequest(drafter=n), timeout=TIMEOUT))
        assert error.code() == Code.INVALID_ARGUMENT, error.details()
        assert "folder name" in error.details() and str(SHIPPED) not in error.details()  # no server path


def test_echoed_strings_stay_short_and_the_real_status_arrives(serve):
    """Before: a 20,000-character session id came back whole in the message; past 16 KiB of metadata the
    client got RESOURCE_EXHAUSTED instead of NOT_FOUND."""
    stub, _ = serve()
    error = refused(lambda: stub.Verify(pb.VerifyRequest(session_id="s" * 20_000), timeout=TIMEOUT))
    assert error.code() == Code.NOT_FOUND and len(error.details()) <= MAX_DETAILS
    error = refused(lambda: stub.Handshake(pb.HandshakeRequest(tokenizer_fingerprint="f" * 20_000), timeout=TIMEOUT))
    assert error.code() == Code.FAILED_PRECONDITION and len(error.details()) <= MAX_DETAILS


def test_undecodable_bodies_are_invalid_arguments_not_internal_errors_and_tracebacks(tiny_target, caplog):
    """Before: each request body that did not parse was INTERNAL and logged an ERROR with a traceback
    (1,191 bodies: 524 KB of log)."""
    server, address, service = start_server(tiny_target)
    try:
        with grpc.insecure_channel(address) as channel, caplog.at_level(logging.DEBUG):
            raw = channel.unary_unary("/splitspec.v1.SplitSpec/Verify")  # bytes in, bytes out
            for i in range(50):
                error = refused(lambda i=i: raw(bytes([0xFF, 0xFF, i, 0x00, 0x12]) * 7, timeout=TIMEOUT))
                assert error.code() == Code.INVALID_ARGUMENT and "is not a VerifyRequest message" in error.details()
            pb_grpc.SplitSpecStub(channel).Probe(pb.ProbeRequest(), timeout=TIMEOUT)  # still serving
    finally:
        server.stop(grace=None)
        service.close()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], "refusals are not worth a log line"
    assert service.metrics.refusals.labels("Verify", "INVALID_ARGUMENT")._value.get() == 50


def test_chunked_prefill_is_bit_identical_in_bf16(tiny_model_dir):
    from shared.engine.models import load_target

    target = load_target(str(tiny_model_dir), dtype="bfloat16")
    prompt = list(range(5, 5 + 77))
    one, chunked = target.session(SamplingParams()), target.session(SamplingParams())
    one.prefill(prompt)
    chunked.prefill(prompt, chunk=16)
    n = len(prompt)
    assert one.tokens == chunked.tokens
    assert (one.cache.k[..., :n, :] == chunked.cache.k[..., :n, :]).all()
    assert (one.cache.v[..., :n, :] == chunked.cache.v[..., :n, :]).all()


def rss_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def test_memory_stays_flat_over_500_abandoned_sessions(serve, tiny_target):
    """Opened and never closed: each is reaped after the TTL by the reaper, not by the next request; the KV
    memory the store holds returns to zero and the process does not grow with the count."""
    stub, service = serve(max_sessions=64, session_ttl_s=0.3, evict_idle_s=30)
    peak, rss = 0, []
    for i in range(500):
        stub.OpenSession(pb.OpenSessionRequest(prompt_ids=[5, 6, 7, i % 200 + 5]), timeout=TIMEOUT)
        peak = max(peak, len(service.sessions))
        if i % 50 == 49:  # waves of 50: fewer than max_sessions, whatever the machine's speed
            deadline = time.monotonic() + 10
            while len(service.sessions) and time.monotonic() < deadline:
                time.sleep(0.05)  # nothing is sent meanwhile: the reaper does it
            assert len(service.sessions) == 0 and service.sessions.nbytes == 0
            rss.append(rss_mb())
    assert service.sessions.expired == 500 and peak <= 64
    assert rss[-1] - rss[0] < 64, rss  # MB: flat, not growing with the sessions


def test_a_call_cancelled_mid_prefill_stops_and_releases_its_place(serve, tiny_target):
    """A long prompt's OpenSession whose deadline passes stops at its next piece instead of computing the rest,
    and the place it held is free at once."""
    stub, service = serve(max_sessions=4, max_context=256, prefill_chunk=1)
    prompt = [5 + i % 200 for i in range(245)]
    error = refused(lambda: stub.OpenSession(pb.OpenSessionRequest(prompt_ids=prompt), timeout=0.05))
    assert error.code() == Code.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 10
    while service.sessions.nbytes and time.monotonic() < deadline:
        time.sleep(0.01)
    assert service.sessions.nbytes == 0 and len(service.sessions) == 0
    forwards = service.metrics.forward_tokens._sum.get()  # prompt tokens computed: fewer than the 245 sent
    assert forwards < 245
    Seq(stub, tiny_target, [5, 6], GREEDY).step()
