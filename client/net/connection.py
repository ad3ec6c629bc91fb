"""A connection to one splitspec server: the calls the client makes on it, each bounded, timed and counted, and what
the heartbeat and the reconnection polls do to it. ``client.net.remote.RemoteVerifier`` turns verdicts into these calls
and their replies back; this module knows nothing of trees or payloads.

No wait here is unbounded: every call has a bound from what was measured (``client.net.deadlines``), enforced in this
process as well as by gRPC's deadline (a wait outlasts it by ``GRACE_S``, then the call is abandoned), a stream's
messages are awaited one gap at a time, and channels are closed off the caller's thread (``close_soon``). A call
that misses its bound is lost: ``LinkDown`` if the server does not answer a probe either, ``SessionLost`` if it does
(its session went with a replica that died behind a live proxy; the next calls take a new route)."""

from __future__ import annotations

import itertools
import queue
import random
import secrets
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import grpc

from client.net.deadlines import GRACE_S, Bounds
from client.net.endpoint import Endpoint
from client.net.failures import LinkDown, ServerFull, SessionLost, rpc_error
from client.net.link import PROBE_MAX_BYTES, LinkMonitor
from shared.channel import (
    CONVERSATION_TOKENS,
    MESSAGE_OPTIONS,
    RECONNECT_OPTIONS,
    ROUTE_KEY,
    close_soon,
    off_thread,
    route_key,  # fmt: skip
)
from shared.errors import SplitspecError
from shared.wire import splitspec_pb2 as pb
from shared.wire import splitspec_pb2_grpc as pb_grpc

T = TypeVar("T")

# the calls on a session (or opening one): they carry its route key, which a cluster of replicas routes by
SESSION_CALLS = frozenset({"OpenSession", "Verify", "CloseSession", "FetchPayload", "Decode"})
ROUTED_CALLS = SESSION_CALLS | {"Complete"}  # the calls that carry the route key (``shared.channel.route_key``)
ADMISSION_TRIES = 32  # a full server's refusals (with a retry hint) an opening call sits out at most
ADMISSION_FIRST_S = 0.05  # the first wait after one; doubling, never past the server's hint
SHUTDOWN_JOIN_S = 2.0  # how long shutdown waits for a reconnection poll's thread to end
POLL_GROWTH = 16  # a reconnection poll's time grows with the polls that failed before it, up to this many times
_END = object()  # a stream's end, as its reader thread hands it over


@dataclass
class LinkCounters:
    """What crossing the link cost so far (protobuf message bytes, not counting HTTP/2 framing).

    Link probes are counted apart (``probe_*``): they measure the link, they are not a generation's traffic.
    """

    server_calls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    server_compute_s: float = 0.0
    probe_calls: int = 0
    probe_bytes: int = 0  # both directions
    payload_bytes: int = 0  # encoded feature payloads received (part of bytes_received), prefills included
    prefill_payload_bytes: int = 0  # the prompts' share of payload_bytes
    payload_refetches: int = 0  # payloads that failed to decode and were asked for again
    reused_tokens: int = 0  # tokens the server took from its prefix cache at each open (reopens after cuts too)

    def since(self, earlier: LinkCounters) -> LinkCounters:
        """What was spent after ``earlier`` was copied: one generation's share of a reused link."""
        return LinkCounters(*(getattr(self, f) - getattr(earlier, f) for f in self.__dataclass_fields__))



def _say(message: str) -> None:
    print(f"splitspec: {message}", file=sys.stderr, flush=True)


class Route:
    """A connection's route key (``ROUTE_KEY``), which a cluster of replicas sends its session's calls by."""

    def __init__(self) -> None:
        self.key = ""
        self._head: list[int] = []  # the first tokens of the prompt the key was kept for

    def follow(self, prompt_ids: list[int]) -> None:
        """The key of the session about to open with ``prompt_ids``: the last one's when the prompt goes on from that
        one's (a conversation's next turn: its prefix is on that replica, even where the first turn was too short for
        a key of its own, or a lost call moved it), else the prompt's ``route_key``."""
        head = list(prompt_ids[:CONVERSATION_TOKENS])
        if not (self.key and self._head and head[: len(self._head)] == self._head):
            self.key = route_key(prompt_ids)
        self._head = head

    def move(self) -> None:
        """A new key for the session's later calls: its replica is presumed gone, so they reach a live one."""
        self.key = secrets.token_hex(8)


class Connection:
    """A splitspec server reached over gRPC, after a Handshake (``info``) that checks both sides share a tokenizer.

    A full server refuses a new session with a retry hint; the opening calls wait for a place for up to
    ``admission_s`` (default: one call's deadline), saying so through ``say`` (default: a line on stderr).

    Threads: the decode loop calls from one thread; the heartbeat's ``abort`` and the reconnection polls
    (``reachable``) come from others. ``_lock`` guards what they share: the channel and stub (a failed poll
    replaces them) and the calls in flight with their abort reasons.
    """

    def __init__(self, endpoint: Endpoint, fingerprint: str = "", connect_timeout_s: float = 10.0,
                 rpc_timeout_s: float = 120.0, admission_s: float | None = None,
                 say: Callable[[str], None] = _say) -> None:  # fmt: skip
        self.endpoint, self.address = endpoint, endpoint.address
        self.rpc_timeout_s = rpc_timeout_s
        self.admission_s = rpc_timeout_s if admission_s is None else admission_s
        self.say = say
        self.counters = LinkCounters()
        self.link = LinkMonitor()
        self.bounds = Bounds(self.link, rpc_timeout_s)  # how long each call may take before it is lost
        self.route = Route()  # the session's route key, set for each session opened (``Route.follow``)
        self.last_heard = 0.0  # time.monotonic() of the last message from the server (a stream's chunks count)
        self.backlog = 0  # bytes the reply in flight is expected to carry (its payload)
        self._lock = threading.Lock()
        # the calls abort() cancels and the heartbeat watches over (two where a chained round follows one in flight),
        # each with why abort() cancelled it ('' while it has not)
        self._inflight: dict[grpc.Future, str] = {}
        self._polls: dict[grpc.Future, threading.Thread] = {}  # reconnection polls under way, and their threads
        self._shut = threading.Event()
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
                f"cannot reach a splitspec server at {self.address} within {connect_timeout_s:g}s; "
                "start one with `splitspec serve` or check --server"
            ) from None
        self.stub = pb_grpc.SplitSpecStub(self.channel)
        self.hello = pb.HandshakeRequest(client="splitspec", tokenizer_fingerprint=fingerprint)
        self.info = self.call("Handshake", self.hello, timeout_s=connect_timeout_s)

    # --- calls: started under the lock, counted once ---

    def start(self, rpc: str, request, timeout_s: float, stream: bool = False, watched: bool = True):
        """Start call ``rpc`` (a future, or a reply stream's iterator). ``watched``: it is the call in flight, which
        ``abort`` cancels and the heartbeat watches over. Under the lock, so that a reconnection poll cannot close
        the channel between taking its stub and starting the call (a call on a channel closed later fails CANCELLED:
        a LinkDown)."""
        with self._lock:
            if self._shut.is_set():
                raise SplitspecError(f"server {self.address}: the connection was shut down; {rpc} not sent")
            method = getattr(self.stub, rpc)
            metadata = ((ROUTE_KEY, self.route.key),) if rpc in ROUTED_CALLS and self.route.key else None
            call = (method(request, timeout=timeout_s, metadata=metadata) if stream
                    else method.future(request, timeout=timeout_s, metadata=metadata))  # fmt: skip
            if watched:
                self._inflight[call] = ""
        return call

    def end(self, call) -> str:
        """``call`` is over: no longer the call in flight. Returns why ``abort`` abandoned it ('' if it did not)."""
        with self._lock:
            return self._inflight.pop(call, "")

    def failed(self, call, exc: Exception, rpc: str, bound_s: float, budget: bool = False) -> Exception:
        """What a failed ``call`` of ``rpc`` raises: LinkDown naming why it was abandoned (``abort``); past its bound
        (``bound_s``), a TimeoutError for a measurement's ``budget`` (an answer rather than a failure), else a lost
        call (``_lost``); else the call's own error (``rpc_error``)."""
        reason = self.end(call)
        if reason or not isinstance(exc, grpc.RpcError):
            self._broken = True
            return LinkDown(f"server {self.address}: call abandoned: {reason or 'cancelled'}")
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return TimeoutError(f"probe took longer than {bound_s:.3f}s") if budget else self.lost(rpc, bound_s)
        return rpc_error(self.address, exc)

    def lost(self, rpc: str, bound_s: float) -> SplitspecError:
        """A call of ``rpc`` unanswered within ``bound_s``. If the server answers a probe now, the link is up and the
        call's session is what is gone (a replica that died behind a proxy that keeps the connection open answers no
        call ever): SessionLost, and the session's later calls take a new route key, so they reach a live replica,
        which says at once that it has no such session, and the client reopens it there. Else LinkDown."""
        if rpc in SESSION_CALLS and self.answers_probe():
            self.route.move()
            return SessionLost(f"server {self.address}: {rpc} unanswered within {bound_s:.2f}s while the server "
                               "answers probes: its session is presumed lost with its replica")  # fmt: skip
        self._broken = True
        return LinkDown(f"server {self.address}: {rpc} unanswered within {bound_s:.2f}s")

    def answers_probe(self) -> bool:
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

    def count(self, sent=None, received=None) -> int:
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

    def timed(self, rpc: str, request, timeout_s: float, budget: bool = False):
        """One unary call: (reply, wall seconds). A failure becomes a SplitspecError naming the server, except
        running past a measurement ``budget``: that is a TimeoutError, an answer rather than a failure. The wait
        here outlasts gRPC's deadline by ``GRACE_S`` at most: a call gRPC never ends is abandoned all the same."""
        start = time.perf_counter()
        future = self.start(rpc, request, timeout_s)
        return self.reply(future, rpc, timeout_s, budget), time.perf_counter() - start

    def reply(self, future, rpc: str, timeout_s: float, budget: bool = False):
        """The reply of unary call ``future`` (started by ``_start``), as ``_timed`` says."""
        try:
            reply = future.result(timeout=timeout_s + GRACE_S)
        except grpc.FutureTimeoutError:
            self.end(future)
            off_thread(future.cancel)
            raise (TimeoutError(f"probe took longer than {timeout_s:.3f}s") if budget
                   else self.lost(rpc, timeout_s)) from None  # fmt: skip
        except (grpc.RpcError, grpc.FutureCancelledError) as exc:
            raise self.failed(future, exc, rpc, timeout_s, budget) from None
        self.end(future)
        return reply

    def call(self, rpc: str, request, timeout_s: float | None = None):
        """One unary call, timed for the link and counted (once it succeeded); ``timeout_s``: its bound (default: a
        call with no model compute, ``Bounds.exchange_s``)."""
        reply, wall_s = self.timed(rpc, request, timeout_s or self.bounds.exchange_s(request.ByteSize()))
        self.link.observe(wall_s, getattr(reply, "compute_s", 0.0), request.ByteSize(), reply.ByteSize())
        self.count(request, reply)
        return reply

    def stream(self, rpc: str, request, timeout_s: float, gap_s: Callable[[int], float], watched: bool = True,
                opens: bool = False):  # fmt: skip
        """Start reply stream ``rpc`` (``timeout_s``: gRPC's deadline for all of it) and wait for its first message (a
        full server refuses before any): (the call, when it was sent, all its messages, each awaited at most
        ``gap_s(i)``, see ``_messages``). ``opens``: the call takes a place on the server, so a refusal for want of one
        is waited out (``_admitted``)."""

        def attempt():
            self.count(request)
            sent = time.perf_counter()
            call = self.start(rpc, request, timeout_s, stream=True, watched=watched)
            messages = self.messages(call, rpc, gap_s)
            first = next(messages, _END)
            return call, sent, itertools.chain([] if first is _END else [first], messages)

        return self.admitted(attempt) if opens else attempt()

    def messages(self, call, rpc: str, gap_s: Callable[[int], float]) -> Iterator:
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
                self.end(call)
                off_thread(call.cancel)
                raise self.lost(rpc, bound) from None
            if item is _END:
                return
            if isinstance(item, Exception):
                raise self.failed(call, item, rpc, bound) from None
            yield item

    def admitted(self, attempt: Callable[[], T]) -> T:
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
        return self.last_heard

    def backlog_s(self) -> float:
        """How long the link needs for the reply in flight, as far as it is known (a payload's size)."""
        return self.link.transfer_s(0, self.backlog) if self._inflight else 0.0

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
            reply, wall_s = self.timed("Probe", request, timeout_s, budget=True)
            self.counters.probe_calls += 1
            self.counters.probe_bytes += request.ByteSize() + reply.ByteSize()
            return wall_s, reply.compute_s

        return self.link.probe(call, budget_s, max_bytes)

    def shutdown(self, timeout_s: float = SHUTDOWN_JOIN_S) -> None:
        """Close the connection for good. A reconnection poll racing it (``client.loop.offline``'s thread) is
        cancelled and its thread waited for (at most ``timeout_s``): no channel is opened after this, and no poll
        outlives it."""
        with self._lock:
            self._shut.set()
            polls, channel = dict(self._polls), self.channel
        for poll in polls:
            off_thread(poll.cancel)
        close_soon(channel)
        deadline = time.monotonic() + timeout_s
        for thread in set(polls.values()) - {threading.current_thread()}:
            thread.join(max(0.0, deadline - time.monotonic()))
