"""The remote ``Verifier``: a splitspec server over gRPC. It times every call it makes, so its ``link`` knows the
round-trip time and bandwidth, and maps failed calls to ``client.failures``.

No wait here is unbounded: every call has a bound from what was measured (``client.deadlines``), enforced in this
process as well as by gRPC's deadline (a wait outlasts it by ``GRACE_S``, then the call is abandoned), a stream's
messages are awaited one gap at a time, and channels are closed off the caller's thread (``close_soon``). A call
that misses its bound is lost: ``LinkDown`` if the server does not answer a probe either, ``SessionLost`` if it does
(its session went with a replica that died behind a live proxy; the next calls take a new route)."""

from __future__ import annotations

import contextlib
import itertools
import queue
import random
import secrets
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import grpc

from client.deadlines import GRACE_S, Bounds
from client.endpoint import Endpoint
from client.failures import LinkDown, ServerFull, SessionLost, Stale, rpc_error
from client.link import PROBE_MAX_BYTES, LinkMonitor
from client.verifiers import NO_PAYLOAD, LinkCounters, Pending, Verifier
from shared import payload
from shared.acceptance import SamplingParams
from shared.channel import MESSAGE_OPTIONS, RECONNECT_OPTIONS, ROUTE_KEY, close_soon, off_thread
from shared.codec import CodecError
from shared.engine.target import Verdict
from shared.errors import SplitspecError
from shared.features import Features
from shared.payload import PayloadSpec
from shared.tree import DraftTree
from shared.wire import splitspec_pb2 as pb
from shared.wire import splitspec_pb2_grpc as pb_grpc

T = TypeVar("T")


def _sampling_msg(sampling: SamplingParams) -> pb.Sampling:
    return pb.Sampling(temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed,
                       acceptance=sampling.acceptance, epsilon=sampling.epsilon, delta=sampling.delta)  # fmt: skip


# the calls on a session (or opening one): they carry its route key, which a cluster of replicas routes by
SESSION_CALLS = frozenset({"OpenSession", "Verify", "CloseSession", "FetchPayload", "Decode"})
PAYLOAD_RETRIES = 2  # a payload that does not decode is fetched again this many times before giving up
ADMISSION_TRIES = 32  # a full server's refusals (with a retry hint) an opening call sits out at most
ADMISSION_FIRST_S = 0.05  # the first wait after one; doubling, never past the server's hint
SHUTDOWN_JOIN_S = 2.0  # how long shutdown waits for a reconnection poll's thread to end
POLL_GROWTH = 16  # a reconnection poll's time grows with the polls that failed before it, up to this many times
_END = object()  # a stream's end, as its reader thread hands it over


def _say(message: str) -> None:
    print(f"splitspec: {message}", file=sys.stderr, flush=True)


class RemoteVerifier(Verifier):
    """A splitspec server reached over gRPC; checks at connect that both sides share a tokenizer.

    Each call's ``spec`` says which features of newly cached tokens the server sends with its reply.
    Given a ``drafter`` whose needs include mode ``lsa``, the Handshake names its bundle (the server
    compares the weights digest with its own copy and loads the LSA); a server that cannot run it
    leaves mode lsa unusable, with a warning, unless ``spec`` (the payload the caller pins, if any; only the
    Handshake reads it) pins lsa: then that is an error. ``bundle``:
    the folder whose weights digest is sent (default: the drafter's).

    A full server refuses a new session with a retry hint; the opening calls wait for a place for up to
    ``admission_s`` (default: one call's deadline), saying so through ``say`` (default: a line on stderr).

    Threads: the decode loop calls from one thread; the heartbeat's ``abort`` and the reconnection polls
    (``reachable``) come from others. ``_lock`` guards what they share: the channel and stub (a failed poll
    replaces them) and the call in flight with its abort reason.
    """

    def __init__(
        self,
        address: str | Endpoint,
        fingerprint: str = "",
        connect_timeout_s: float = 10.0,
        rpc_timeout_s: float = 120.0,
        drafter=None,
        spec: PayloadSpec = PayloadSpec(),
        bundle=None,
        admission_s: float | None = None,
        say: Callable[[str], None] = _say,
    ):
        self.endpoint = address if isinstance(address, Endpoint) else Endpoint(address)
        self.address = address = self.endpoint.address
        self.rpc_timeout_s = rpc_timeout_s
        self.admission_s = rpc_timeout_s if admission_s is None else admission_s
        self.say = say
        self.counters = LinkCounters()
        self.link = LinkMonitor()
        self.bounds = Bounds(self.link, rpc_timeout_s)  # how long each call may take before it is lost
        self.session_id = ""
        self.route = ""  # the session's route key (``ROUTE_KEY``), drawn anew for each session opened
        self.length = 0
        self._lock = threading.Lock()
        # the calls abort() cancels and the heartbeat watches over (two where a chained round follows one in flight),
        # each with why abort() cancelled it ('' while it has not)
        self._inflight: dict[grpc.Future, str] = {}
        self._polls: dict[grpc.Future, threading.Thread] = {}  # reconnection polls under way, and their threads
        self._shut = threading.Event()
        self._heard = 0.0  # time.monotonic() of the last message from the server (a stream's chunks count)
        self._backlog = 0  # bytes the reply in flight is expected to carry (its payload)
        self._closing: grpc.Future | None = None  # a CloseSession sent without waiting (see close)
        self._broken = False  # a call was lost for the link on this channel: the next poll opens another
        self._missed = 0  # reconnection polls that failed in a row
        # a connection of its own: gRPC shares one among channels of the same target and options, so a new channel
        # (``_renew``) would otherwise reuse the very connection a cut left dead (seen: every poll after a loud cut
        # with two calls in flight waited out its deadline, for as long as the bench ran)
        self._options = [("grpc.use_local_subchannel_pool", 1), *MESSAGE_OPTIONS, *RECONNECT_OPTIONS]
        self.channel = self.endpoint.channel(self._options)
        try:
            grpc.channel_ready_future(self.channel).result(timeout=connect_timeout_s)
        except grpc.FutureTimeoutError:
            close_soon(self.channel)
            raise SplitspecError(
                f"cannot reach a splitspec server at {address} within {connect_timeout_s:g}s; "
                "start one with `splitspec serve` or check --server"
            ) from None
        self.stub = pb_grpc.SplitSpecStub(self.channel)
        self.hello = pb.HandshakeRequest(client="splitspec", tokenizer_fingerprint=fingerprint)
        self.info = self._call("Handshake", self.hello, timeout_s=connect_timeout_s)
        self.lsa_drafter = ""  # whose LSA the server runs for us (mode lsa), if any
        lsa = [s for s in (drafter.payload_specs() if drafter is not None else []) if s.mode == "lsa"]
        if spec.mode == "lsa" or (lsa and not spec):
            name = spec.drafter if spec.mode == "lsa" else lsa[0].drafter
            self._name_drafter(name, bundle or (drafter.bundle if drafter else None), pinned=spec.mode == "lsa")
        info = self.info
        self.dims = (info.num_layers, 2 * info.num_kv_heads * info.head_dim, info.hidden_size)
        self.eos_token_ids = list(self.info.eos_token_ids)
        self.max_tree_nodes = self.info.limits.max_tree_nodes
        self.chains = self.info.limits.chained_verify
        self.max_context = self.info.limits.max_context

    def _name_drafter(self, name: str, bundle, pinned: bool) -> None:
        """Handshake again naming drafter ``name`` so the server runs its LSA; the hello is sent again on
        reconnection (a restarted server must load the LSA again)."""
        from shared.lsa import weights_digest

        if bundle is None:
            raise SplitspecError(f"payload mode lsa needs the bundle of drafter {name!r}")
        hello = pb.HandshakeRequest()
        hello.CopyFrom(self.hello)
        hello.drafter, hello.drafter_digest = name, weights_digest(bundle)
        try:
            self._call("Handshake", hello, timeout_s=self.rpc_timeout_s)  # the server loads the drafter's LSA
        except LinkDown:
            raise
        except SplitspecError as exc:
            if pinned:
                raise
            self.say(f"payload mode lsa unavailable ({exc}); using kv")
            return
        self.hello, self.lsa_drafter = hello, name

    def usable(self, specs: list[PayloadSpec]) -> list[PayloadSpec]:
        return [s for s in specs if s.mode != "lsa" or s.drafter == self.lsa_drafter]

    # --- calls: started under the lock, counted once ---

    def _start(self, rpc: str, request, timeout_s: float, stream: bool = False, watched: bool = True):
        """Start call ``rpc`` (a future, or a reply stream's iterator). ``watched``: it is the call in flight, which
        ``abort`` cancels and the heartbeat watches over. Under the lock, so that a reconnection poll cannot close
        the channel between taking its stub and starting the call (a call on a channel closed later fails CANCELLED:
        a LinkDown)."""
        with self._lock:
            if self._shut.is_set():
                raise SplitspecError(f"server {self.address}: the connection was shut down; {rpc} not sent")
            method = getattr(self.stub, rpc)
            metadata = ((ROUTE_KEY, self.route),) if rpc in SESSION_CALLS and self.route else None
            call = (method(request, timeout=timeout_s, metadata=metadata) if stream
                    else method.future(request, timeout=timeout_s, metadata=metadata))  # fmt: skip
            if watched:
                self._inflight[call] = ""
        return call

    def _end(self, call) -> str:
        """``call`` is over: no longer the call in flight. Returns why ``abort`` abandoned it ('' if it did not)."""
        with self._lock:
            return self._inflight.pop(call, "")

    def _failed(self, call, exc: Exception, rpc: str, bound_s: float, budget: bool = False) -> Exception:
        """What a failed ``call`` of ``rpc`` raises: LinkDown naming why it was abandoned (``abort``); past its bound
        (``bound_s``), a TimeoutError for a measurement's ``budget`` (an answer rather than a failure), else a lost
        call (``_lost``); else the call's own error (``rpc_error``)."""
        reason = self._end(call)
        if reason or not isinstance(exc, grpc.RpcError):
            self._broken = True
            return LinkDown(f"server {self.address}: call abandoned: {reason or 'cancelled'}")
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return TimeoutError(f"probe took longer than {bound_s:.3f}s") if budget else self._lost(rpc, bound_s)
        return rpc_error(self.address, exc)

    def _lost(self, rpc: str, bound_s: float) -> SplitspecError:
        """A call of ``rpc`` unanswered within ``bound_s``. If the server answers a probe now, the link is up and the
        call's session is what is gone (a replica that died behind a proxy that keeps the connection open answers no
        call ever): SessionLost, and the session's later calls take a new route key, so they reach a live replica,
        which says at once that it has no such session, and the client reopens it there. Else LinkDown."""
        if rpc in SESSION_CALLS and self._answers_probe():
            self.route = secrets.token_hex(8)
            return SessionLost(f"server {self.address}: {rpc} unanswered within {bound_s:.2f}s while the server "
                               "answers probes: its session is presumed lost with its replica")  # fmt: skip
        self._broken = True
        return LinkDown(f"server {self.address}: {rpc} unanswered within {bound_s:.2f}s")

    def _answers_probe(self) -> bool:
        """One Probe within ``Bounds.probe_s``: does the server answer at all?"""
        bound = self.bounds.probe_s()
        with self._lock:
            if self._shut.is_set():
                return False
            probe = self.stub.Probe.future(pb.ProbeRequest(), timeout=bound)
        try:
            probe.result(timeout=bound + GRACE_S)
            return True
        except (grpc.RpcError, grpc.FutureCancelledError, grpc.FutureTimeoutError):
            off_thread(probe.cancel)
            return False

    def _count(self, sent=None, received=None) -> int:
        """Count what crossed the link in ``counters``: a call made with request ``sent``; a message ``received`` (a
        reply, a stream's chunk) with the server's compute it reports. Returns the received message's size."""
        c = self.counters
        if sent is not None:
            c.server_calls += 1
            c.bytes_sent += sent.ByteSize()
        if received is None:
            return 0
        size = received.ByteSize()
        c.bytes_received += size
        c.server_compute_s += getattr(received, "compute_s", 0.0)
        return size

    def _timed(self, rpc: str, request, timeout_s: float, budget: bool = False):
        """One unary call: (reply, wall seconds). A failure becomes a SplitspecError naming the server, except
        running past a measurement ``budget``: that is a TimeoutError, an answer rather than a failure. The wait
        here outlasts gRPC's deadline by ``GRACE_S`` at most: a call gRPC never ends is abandoned all the same."""
        start = time.perf_counter()
        future = self._start(rpc, request, timeout_s)
        return self._reply(future, rpc, timeout_s, budget), time.perf_counter() - start

    def _reply(self, future, rpc: str, timeout_s: float, budget: bool = False):
        """The reply of unary call ``future`` (started by ``_start``), as ``_timed`` says."""
        try:
            reply = future.result(timeout=timeout_s + GRACE_S)
        except grpc.FutureTimeoutError:
            self._end(future)
            off_thread(future.cancel)
            raise (TimeoutError(f"probe took longer than {timeout_s:.3f}s") if budget
                   else self._lost(rpc, timeout_s)) from None  # fmt: skip
        except (grpc.RpcError, grpc.FutureCancelledError) as exc:
            raise self._failed(future, exc, rpc, timeout_s, budget) from None
        self._end(future)
        return reply

    def _call(self, rpc: str, request, timeout_s: float | None = None):
        """One unary call, timed for the link and counted (once it succeeded); ``timeout_s``: its bound (default: a
        call with no model compute, ``Bounds.exchange_s``)."""
        reply, wall_s = self._timed(rpc, request, timeout_s or self.bounds.exchange_s(request.ByteSize()))
        self.link.observe(wall_s, getattr(reply, "compute_s", 0.0), request.ByteSize(), reply.ByteSize())
        self._count(request, reply)
        return reply

    def _stream(self, rpc: str, request, timeout_s: float, gap_s: Callable[[int], float], watched: bool = True,
                opens: bool = False):  # fmt: skip
        """Start reply stream ``rpc`` (``timeout_s``: gRPC's deadline for all of it) and wait for its first message (a
        full server refuses before any): (the call, when it was sent, all its messages, each awaited at most
        ``gap_s(i)``, see ``_messages``). ``opens``: the call takes a place on the server, so a refusal for want of one
        is waited out (``_admitted``)."""

        def attempt():
            self._count(request)
            sent = time.perf_counter()
            call = self._start(rpc, request, timeout_s, stream=True, watched=watched)
            messages = self._messages(call, rpc, gap_s)
            first = next(messages, _END)
            return call, sent, itertools.chain([] if first is _END else [first], messages)

        return self._admitted(attempt) if opens else attempt()

    def _messages(self, call, rpc: str, gap_s: Callable[[int], float]) -> Iterator:
        """The messages of stream ``call``, message ``i`` awaited at most ``gap_s(i)`` after the one before: one late
        past that abandons the call (``_lost``); a failed stream raises what ``_failed`` says. A daemon thread reads the
        stream, so that no wait here depends on gRPC ending it."""
        inbox: queue.SimpleQueue = queue.SimpleQueue()

        def read() -> None:
            try:
                for message in call:
                    inbox.put(message)
                inbox.put(_END)
            except Exception as exc:  # noqa: BLE001 - handed to the reader
                inbox.put(exc)

        off_thread(read, name="splitspec-stream")
        for i in itertools.count():
            bound = gap_s(i)
            try:
                item = inbox.get(timeout=bound)
            except queue.Empty:
                self._end(call)
                off_thread(call.cancel)
                raise self._lost(rpc, bound) from None
            if item is _END:
                return
            if isinstance(item, Exception):
                raise self._failed(call, item, rpc, bound) from None
            yield item

    def _admitted(self, attempt: Callable[[], T]) -> T:
        """``attempt()``, a call that takes a place on the server, again while a full server refuses it with a retry
        hint (``ServerFull``): waits of ADMISSION_FIRST_S doubling, never past the hint, jittered (the refused
        clients should not all come back at once), within ``admission_s`` and ADMISSION_TRIES; then the refusal is
        raised. The first refusal is told (``say``): the wait may be long, and it is not the link's fault."""
        began, delay = time.monotonic(), ADMISSION_FIRST_S
        for tries in range(1, ADMISSION_TRIES + 1):
            try:
                return attempt()
            except ServerFull as exc:
                waited = time.monotonic() - began
                left = self.admission_s - waited
                if tries == ADMISSION_TRIES or left <= 0:
                    raise ServerFull(f"{exc}; gave up after {tries} tries in {waited:.2f}s", exc.retry_s) from None
                if tries == 1:
                    self.say(f"{exc}; waiting up to {left:.1f}s for a place")
                self._shut.wait(min(delay, exc.retry_s, left) * random.uniform(0.5, 1.0))
                delay *= 2
        raise AssertionError("unreachable: the last try returns or raises")

    # --- what the heartbeat and the reconnection thread call ---

    def abort(self, reason: str) -> None:
        """Abandon the calls in flight, if any (from another thread: the heartbeat found the link dead);
        their callers see LinkDown naming ``reason``."""
        with self._lock:
            calls = list(self._inflight)
            for call in calls:
                self._inflight[call] = reason
        for call in calls:
            call.cancel()

    @property
    def busy(self) -> bool:
        return bool(self._inflight)

    def heard(self) -> float:
        return self._heard

    def backlog_s(self) -> float:
        """How long the link needs for the reply in flight, as far as it is known (a payload's size)."""
        return self.link.transfer_s(0, self._backlog) if self._inflight else 0.0

    def reachable(self, timeout_s: float = 1.0) -> bool:
        """One Handshake within ``timeout_s``: is the server there again? (Reconnection polls this, from a thread
        of its own; the poll is not the call in flight.)

        A failed poll replaces the channel, so the next one starts on a new connection, and so does the first poll
        after a call was lost for the link (``_broken``): a silent cut drops bytes mid-stream, and a connection that
        lost some may still answer a Handshake while its HTTP/2 header tables no longer agree with the server's (seen:
        an OpenSession after a restored silent cut reached the server as a malformed Handshake, INVALID_ARGUMENT).
        ``shutdown`` cancels a poll under way and waits for its thread; after it, polls fail at once and open nothing.
        """
        with self._lock:
            if self._shut.is_set():
                return False
            if self._broken:
                self._renew()
            # each poll that failed in a row doubles the next one's time (at most POLL_GROWTH times): a poll opens a
            # new connection, which on a starved machine may take longer than the round trips a poll is given
            timeout_s *= min(2**self._missed, POLL_GROWTH)
            poll = self.stub.Handshake.future(self.hello, timeout=timeout_s)
            self._polls[poll] = threading.current_thread()
        try:
            poll.result(timeout=timeout_s + GRACE_S)
            self._missed = 0
            return True
        except (grpc.RpcError, grpc.FutureCancelledError, grpc.FutureTimeoutError):
            self._missed += 1
            off_thread(poll.cancel)
            with self._lock:
                if self._shut.is_set():
                    return False
                self._renew()
            return False
        finally:
            with self._lock:
                del self._polls[poll]

    def _renew(self) -> None:
        """A new channel (a new connection) in place of the old, which is closed soon (under the lock)."""
        old, self.channel = self.channel, self.endpoint.channel(self._options)
        self.stub, self._broken = pb_grpc.SplitSpecStub(self.channel), False
        close_soon(old)

    def probe_link(self, budget_s: float = 1.5) -> dict[str, float | None]:
        """Measure the link now with Probe calls (see ``LinkMonitor.probe``); counted apart, in ``counters.probe_*``."""
        max_bytes = min(PROBE_MAX_BYTES, self.info.limits.max_probe_bytes or PROBE_MAX_BYTES)

        def call(payload_bytes: int, reply_bytes: int, timeout_s: float) -> tuple[float, float]:
            request = pb.ProbeRequest(payload=bytes(payload_bytes), reply_bytes=reply_bytes)
            reply, wall_s = self._timed("Probe", request, timeout_s, budget=True)
            self.counters.probe_calls += 1
            self.counters.probe_bytes += request.ByteSize() + reply.ByteSize()
            return wall_s, reply.compute_s

        return self.link.probe(call, budget_s, max_bytes)

    # --- the Verifier interface ---

    def open(self, prompt_ids: list[int], sampling: SamplingParams, *, spec: PayloadSpec = NO_PAYLOAD) -> Verdict:
        self._closed()
        request = pb.OpenSessionRequest(prompt_ids=prompt_ids, sampling=_sampling_msg(sampling),
                                        payload=spec.to_msg())  # fmt: skip
        self._backlog = int(len(prompt_ids) * self.payload_bytes_per_token(spec))
        self.route = secrets.token_hex(8)
        bound = self.bounds.call_s(len(prompt_ids), request.ByteSize(), self._backlog)
        try:
            reply = self._admitted(lambda: self._call("OpenSession", request, timeout_s=bound))
        finally:
            self._backlog = 0
        self.bounds.observe(len(prompt_ids), reply.compute_s)
        self.session_id, self.length = reply.session_id, reply.length
        before = self.counters.payload_bytes
        features = self._features(reply.payload, spec)
        self.counters.prefill_payload_bytes += self.counters.payload_bytes - before
        return Verdict([], [reply.first_token], reply.compute_s, features, load=reply.load)

    def verify(self, tree: DraftTree, timeout_s: float | None = None, *, spec: PayloadSpec = NO_PAYLOAD) -> Verdict:
        """One round; ``timeout_s`` overrides the call's bound (default: ``Bounds.call_s`` for the tree)."""
        request = pb.VerifyRequest(session_id=self.session_id, tokens=tree.tokens, parents=tree.parents,
                                   length=self.length, payload=spec.to_msg())  # fmt: skip
        return self._verdict(tree, spec, self._call("Verify", request, self._bound(request, tree, spec, timeout_s)))

    def verify_after(self, length: int, assumed: list[int], tree: DraftTree, timeout_s: float | None = None, *,
                     spec: PayloadSpec = NO_PAYLOAD) -> Pending:  # fmt: skip
        """Sent now; the reply is read and taken by ``verdict()`` only, on the loop's thread, after the round before's
        (whose reply sets the length this one's follows). Its wall time holds the wait for the round before: it does
        not time the link."""
        request = pb.VerifyRequest(session_id=self.session_id, tokens=tree.tokens, parents=tree.parents,
                                   length=length, assumed=assumed, payload=spec.to_msg())  # fmt: skip
        bound = self._bound(request, tree, spec, timeout_s)
        future = self._start("Verify", request, bound)

        def verdict() -> Verdict:
            reply = self._reply(future, "Verify", bound)
            self._count(request, reply)
            if reply.stale:
                raise Stale(f"server {self.address}: the round before did not commit the {len(assumed)} tokens a "
                            "chained round assumed")  # fmt: skip
            return self._verdict(tree, spec, reply)

        def drop() -> None:
            self._end(future)
            off_thread(future.cancel)

        return Pending(verdict, drop, future.done)

    def _bound(self, request: pb.VerifyRequest, tree: DraftTree, spec: PayloadSpec, timeout_s: float | None) -> float:
        """A Verify's bound: ``timeout_s``, else ``Bounds.call_s`` for the tree and its reply's payload."""
        down = int((len(tree) + 1) * self.payload_bytes_per_token(spec))
        return timeout_s or self.bounds.call_s(len(tree) + 1, request.ByteSize(), down)

    def _verdict(self, tree: DraftTree, spec: PayloadSpec, reply: pb.VerifyReply) -> Verdict:
        """A Verify's reply taken: the session's length moves on by it."""
        self.bounds.observe(len(tree) + 1, reply.compute_s)
        self.length = reply.length
        accepted = list(reply.accepted)
        new = [tree.tokens[i] for i in accepted] + [reply.bonus_token]
        verified = reply.verified or len(tree)  # 0: an older server, which verifies every node
        return Verdict(accepted, new, reply.compute_s, self._features(reply.payload, spec), verified, reply.load)

    def decode(self, max_new_tokens: int, stop_ids: list[int], payload_every: int = 1,
               timeout_s: float | None = None, lookup: int = 0, *, spec: PayloadSpec = NO_PAYLOAD
               ) -> Iterator[Verdict]:  # fmt: skip
        """The server decodes the session by itself and streams each token with the payload of the token it cached
        (the Decode call): no round trip per token. Closing the iterator cancels the stream; the tokens the server
        made past what was received are the next call's first (its ``length`` says where). ``timeout_s`` bounds the
        whole stream (a silent cut is noticed by the heartbeat, which aborts it)."""
        request = pb.DecodeRequest(session_id=self.session_id, length=self.length, max_new_tokens=max_new_tokens,
                                   stop_token_ids=stop_ids, payload=spec.to_msg(),
                                   payload_every=payload_every, lookup=lookup)  # fmt: skip
        return self._decode(request, payload_every, timeout_s, spec)

    def open_decode(self, prompt_ids: list[int], sampling: SamplingParams, max_new_tokens: int, stop_ids: list[int],
                    payload_every: int = 1, timeout_s: float | None = None, lookup: int = 0, *,
                    spec: PayloadSpec = NO_PAYLOAD) -> Iterator[Verdict]:  # fmt: skip
        request = pb.DecodeRequest(prompt_ids=prompt_ids, sampling=_sampling_msg(sampling),
                                   max_new_tokens=max_new_tokens, stop_token_ids=stop_ids, payload=spec.to_msg(),
                                   payload_every=payload_every, lookup=lookup)  # fmt: skip
        self._closed()
        self.session_id, self.length, self.route = "", 0, secrets.token_hex(8)
        return self._decode(request, payload_every, timeout_s, spec, prompt=len(prompt_ids))

    def _decode(self, request: pb.DecodeRequest, payload_every: int, timeout_s: float | None, spec: PayloadSpec,
                prompt: int = 0) -> Iterator[Verdict]:  # fmt: skip
        """A Decode call's chunks as rounds; ``prompt``: the prompt's length when the call opens the session (its
        features come with the first payload; a full server's refusal is waited out)."""
        c = self.counters
        timeout_s = timeout_s or self.rpc_timeout_s + request.max_new_tokens
        per_token = self.payload_bytes_per_token(spec)
        self._backlog = int((prompt + payload_every) * per_token)
        first_bound = self.bounds.call_s(max(prompt, 1), request.ByteSize(), self._backlog)
        steps = max(1, request.lookup + 1)  # a chunk may wait for a verified guess of the server's own lookup

        def gap_s(i: int) -> float:  # the first chunk waits for the prefill (or a step), the others for a step each
            return first_bound if i == 0 else self.bounds.call_s(steps, 0, self._backlog)  # (the prompt's features)

        call = None
        try:
            call, start, chunks = self._stream("Decode", request, timeout_s, gap_s, opens=bool(prompt))
            for i, chunk in enumerate(chunks):
                size, arrived = chunk.ByteSize(), time.perf_counter()
                self.bounds.observe(prompt if i == 0 and prompt else 1, chunk.compute_s)
                if i == 0:  # the first token is one round trip around a step; later ones are pipelined
                    self.link.observe(arrived - start, chunk.compute_s, request.ByteSize(), size)
                    self.session_id = chunk.session_id or self.session_id
                elif i == 1 and prompt:  # the prompt's features, after the small first chunk: the link's rate
                    self.link.observe_gap(arrived - start, chunk.compute_s, size)
                start = arrived
                self._count(received=chunk)
                self.length, self._heard = chunk.length, time.monotonic()
                features = None
                if chunk.HasField("payload"):
                    before = c.payload_bytes
                    features = self._features(chunk.payload, spec)
                    if prompt and features is not None and features.start == 0:  # the prompt's, deferred
                        c.prefill_payload_bytes += c.payload_bytes - before
                        self._backlog = int(payload_every * self.payload_bytes_per_token(spec))
                yield Verdict([], [chunk.token], chunk.compute_s, features,
                            load=chunk.load if chunk.HasField("load") else None)  # fmt: skip
        finally:
            self._backlog = 0
            if call is not None:
                self._end(call)
                off_thread(call.cancel)  # the consumer stopped early (a stop string, a switch): end the stream

    def payload_bytes_per_token(self, spec: PayloadSpec) -> float:
        """Raw bytes (before zstd) one token's payload takes in ``spec`` on this server's target."""
        return payload.raw_bytes_per_token(spec, *self.dims) if spec else 0.0

    def _features(self, msg: pb.Payload, spec: PayloadSpec) -> Features | None:
        """Decode a reply's payload in ``spec``; fetch it (again) when it is pending or does not decode."""
        if not spec:
            return None
        self.counters.payload_bytes += msg.ByteSize()
        shapes = payload.expected_shapes(spec, msg.count, *self.dims)
        error: Exception | None = None
        if not msg.pending:
            try:
                return payload.decode(msg, shapes)
            except CodecError as exc:
                error = exc
                self.counters.payload_refetches += 1
        for _ in range(PAYLOAD_RETRIES):
            try:
                return self.fetch(msg.start, msg.start + msg.count, spec)
            except CodecError as exc:
                error = exc
                self.counters.payload_refetches += 1
        raise SplitspecError(f"server {self.address}: payload for tokens [{msg.start}, {msg.start + msg.count}) "
                             f"does not decode after {PAYLOAD_RETRIES} re-requests: {error}")  # fmt: skip

    def fetch(self, start: int, end: int, spec: PayloadSpec) -> Features:
        """FetchPayload: the features of cached tokens [start, end) in ``spec``, streamed in chunks (those a cut kept
        from arriving, or a payload too big to ride inline)."""
        request = pb.FetchPayloadRequest(session_id=self.session_id, start=start, end=end, spec=spec.to_msg())
        self._count(request)
        parts = []
        # each chunk may take what encoding and moving all the range would (the server reports no compute for it)
        bound = self.bounds.call_s(end - start, 0, int((end - start) * self.payload_bytes_per_token(spec)))
        call = self._start("FetchPayload", request, self.rpc_timeout_s, stream=True, watched=False)
        for chunk in self._messages(call, "FetchPayload", lambda i: bound):  # not a link sample: see above
            self.counters.payload_bytes += self._count(received=chunk)
            shapes = payload.expected_shapes(spec, chunk.count, *self.dims)
            parts.append(payload.decode(chunk, shapes))
        features = payload.concat(parts)
        if features.start != start or len(features) != end - start:
            got = f"[{features.start}, {features.start + len(features)})"
            raise CodecError(f"FetchPayload returned tokens {got}, asked for [{start}, {end})")
        return features

    def close(self, timeout_s: float | None = None, wait: bool = True) -> None:
        if not self.session_id:
            return
        request = pb.CloseSessionRequest(session_id=self.session_id)
        self.session_id = ""
        if wait:
            self._call("CloseSession", request, timeout_s=timeout_s)
            return
        self._count(request)
        self._closing = self._start("CloseSession", request, timeout_s or self.bounds.exchange_s(), watched=False)

    def _closed(self) -> None:
        """Wait for a close sent without waiting, however it ended (within its bound): the next session should not
        find the server's store still holding this one's place."""
        if self._closing is not None:
            with contextlib.suppress(grpc.RpcError, grpc.FutureCancelledError, grpc.FutureTimeoutError):
                self._closing.result(timeout=self.bounds.exchange_s() + GRACE_S)
            self._closing = None

    def api_tokens(self, prompt_ids: list[int], sampling: SamplingParams, max_new_tokens: int, stop_ids: list[int]):
        """The Generate call: the server's plain streaming decode (the API baseline); yields lists of tokens."""
        request = pb.GenerateRequest(
            prompt_ids=prompt_ids,
            sampling=_sampling_msg(sampling),
            max_new_tokens=max_new_tokens,
            stop_token_ids=stop_ids,
        )
        first_bound = self.bounds.call_s(len(prompt_ids), request.ByteSize())

        def gap_s(i: int) -> float:  # the first chunk waits for the prefill, the others for a step each
            return first_bound if i == 0 else self.bounds.call_s(1)

        # gRPC's deadline covers the whole stream: allow a generous second per requested token
        call, start, chunks = self._stream("Generate", request, self.rpc_timeout_s + max_new_tokens, gap_s,
                                           watched=False, opens=True)  # fmt: skip
        for i, chunk in enumerate(chunks):
            size = self._count(received=chunk)
            self.bounds.observe(len(prompt_ids) if i == 0 else max(1, len(chunk.tokens)), chunk.compute_s)
            if i == 0:  # the first chunk is one round trip around the prefill; later ones are pipelined
                self.link.observe(time.perf_counter() - start, chunk.compute_s, request.ByteSize(), size)
            yield list(chunk.tokens)

    def shutdown(self, timeout_s: float = SHUTDOWN_JOIN_S) -> None:
        """Close the connection for good. A reconnection poll racing it (``client.offline``'s thread) is cancelled and
        its thread waited for (at most ``timeout_s``): no channel is opened after this, and no poll outlives it."""
        self._closed()
        with self._lock:
            self._shut.set()
            polls, channel = dict(self._polls), self.channel
        for poll in polls:
            off_thread(poll.cancel)
        close_soon(channel)
        deadline = time.monotonic() + timeout_s
        for thread in set(polls.values()) - {threading.current_thread()}:
            thread.join(max(0.0, deadline - time.monotonic()))
