"""Knowing the link is dead within about two round trips, whatever the server is busy with.

A Verify's own deadline has to allow for the server's compute (a tree on a big target takes a
while), so by itself it notices a silent cut late. The heartbeat asks a different question: empty
Probe calls, every half round trip, each with a deadline of one RTT bound (SRTT + 4·RTTVAR, as a
TCP retransmission timer) plus a margin. The server answers them at once even mid-Verify. The first
one unanswered marks the link dead and fires the callbacks (the decode loop cancels its Verify and
generates offline); a cut is thus noticed within interval + deadline, about 2 x RTT + 50 ms.

gRPC's own keepalive pings cannot do this: gRPC core sends at most one per second.

Probes go out only while a call is in flight (``busy``): between calls there is nothing to cancel,
and the next call starts the probing again; on a healthy link that saves the probes (and the CPU
the client, the server and any proxy spend on them) of the time the client spends drafting.

Nor while the main connection has been heard from within the last interval: a stream's chunks arriving say
the link is up as well as a probe would (and on a one-core server each probe takes a moment from decoding); a
silent cut is then noticed within interval + deadline of the last chunk.
The probes travel on a connection of their own (a local subchannel pool), so they never queue behind
a large payload on the main connection and cannot delay it; while the link is marked dead no probes
are sent (the reconnection poll takes over) until ``revive``.

``close`` may come while the thread is reconnecting (waiting for a new connection to come up, seconds on a dead
link): the wait is cancelled, the thread joined, and a connection swapped in after ``close`` is impossible (the
swap and every probe happen under the lock, after checking that the heartbeat is not closed).

Nothing here waits on gRPC's housekeeping: a replaced or closed connection is closed off this thread
(``close_soon``: ``grpc.Channel.close`` has been seen to block for good), and a probe gRPC never ends — its
callback never comes — is counted unanswered by the thread itself once its deadline is ``GRACE_S`` past.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc

from client.net.deadlines import GRACE_S
from client.net.endpoint import Endpoint
from client.net.link import LinkMonitor
from shared.channel import RECONNECT_OPTIONS, close_soon, off_thread
from shared.wire import splitspec_pb2 as pb
from shared.wire import splitspec_pb2_grpc as pb_grpc

MIN_INTERVAL_S = 0.025
MARGIN_S = 0.05
UNMEASURED_DEADLINE_S = 1.0  # before the link has an RTT estimate
READY_WAIT_S = 0.5  # the least time a new heartbeat connection gets to come up
JOIN_S = 1.0  # how long close waits for the thread to end


class Heartbeat:
    """Probes the server at ``endpoint`` on a connection of its own while alive; ``dead`` is set at the first
    unanswered probe."""

    def __init__(self, endpoint: Endpoint, link: LinkMonitor, min_interval_s: float = MIN_INTERVAL_S,
                 margin_s: float = MARGIN_S, busy: Callable[[], bool] = lambda: True,
                 heard: Callable[[], float] = lambda: 0.0, backlog_s: Callable[[], float] = lambda: 0.0,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        """``heard()``: when (on ``clock``) the main connection last received something from the server —
        a probe unanswered while the server's stream kept arriving meant a congested link, not a cut one;
        ``backlog_s()``: how long the link needs for the reply in flight (a prompt's payload on a slow link), which
        a probe's answer may queue behind. ``clock``: what every decision on elapsed time reads (a quiet link, a
        probe past its deadline), injectable so that tests decide them without waiting; the waits between probes
        stay real."""
        self.link, self.min_interval_s, self.margin_s, self.busy = link, min_interval_s, margin_s, busy
        self.heard, self.backlog_s, self.clock = heard, backlog_s, clock
        self.endpoint = endpoint
        self.generation = 0  # which connection: a failure on a replaced one is not news
        self.channel = self._connect()
        self.stub = pb_grpc.SplitSpecStub(self.channel)
        self.dead = threading.Event()
        self.reason = ""
        self.probes = 0
        self._callbacks: list[Callable[[str], None]] = []
        self._lock = threading.Lock()  # guards channel, stub, generation, the readiness wait and dead/reason
        self._readying: grpc.Future | None = None  # the wait for a connection to come up, which close cancels
        self._pending: dict[grpc.Future, tuple[float, float, int]] = {}  # probes out: (sent, deadline, generation)
        self._stop = threading.Event()
        self._fresh = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="splitspec-heartbeat")

    def on_dead(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` (from a gRPC or heartbeat thread) each time the link is found dead."""
        self._callbacks.append(callback)

    def interval_s(self) -> float:
        return max(self.min_interval_s, (self.link.srtt_s or 0.0) / 2)

    def deadline_s(self) -> float:
        bound = self.link.timeout_s()
        return (UNMEASURED_DEADLINE_S if bound is None else bound) + self.margin_s + self.backlog_s()

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def revive(self) -> None:
        """The link works again (the caller has just talked to the server): resume probing, on a new
        connection — the old one was closed by the cut, or lost bytes in it and is beyond repair."""
        with self._lock:
            self.dead.clear()
            self.reason = ""
            self._fresh.set()

    def close(self, timeout_s: float = JOIN_S) -> None:
        """Stop probing, end the thread (a reconnection under way included; waited for at most ``timeout_s``) and
        close the connection: nothing of the heartbeat outlives this."""
        with self._lock:
            self._stop.set()
            readying, channel = self._readying, self.channel
        if readying is not None:
            off_thread(readying.cancel)
        if self._thread.ident is not None:  # started
            self._thread.join(timeout=timeout_s)
        close_soon(channel)

    def _connect(self) -> grpc.Channel:
        # a TCP connection of its own, not the Verify one
        return self.endpoint.channel([("grpc.use_local_subchannel_pool", 1), *RECONNECT_OPTIONS])

    def _reconnect(self) -> None:
        """A new connection, ready before the first probe: failures of the old one no longer count."""
        with self._lock:
            if self._stop.is_set():
                return  # closed meanwhile: close() closes the channel it saw, so swap in none after it
            old = self.channel
            self.generation += 1
            self.channel = self._connect()
            self.stub = pb_grpc.SplitSpecStub(self.channel)
            self._pending.clear()  # about the old connection: not news
        close_soon(old)
        self._ready("reconnect")

    def _ready(self, doing: str) -> None:
        """Wait for the connection to come up (a TCP and HTTP/2 handshake: several round trips on a slow link), so
        that the first probe is not refused for a connection still opening. ``close`` cancels the wait."""
        wait = max(READY_WAIT_S, 4 * self.deadline_s())
        with self._lock:
            if self._stop.is_set():
                return
            self._readying = ready = grpc.channel_ready_future(self.channel)
            generation = self.generation
        try:
            ready.result(timeout=wait)
        except grpc.FutureCancelledError:
            return  # closing
        except grpc.FutureTimeoutError:
            off_thread(ready.cancel)  # (it would go on watching the channel)
            self._mark_dead(f"heartbeat could not {doing} within {1000 * wait:.0f} ms", generation)
        finally:
            with self._lock:
                self._readying = None

    def _run(self) -> None:
        self._ready("connect")
        while not self._stop.is_set():
            if self._fresh.is_set():
                self._fresh.clear()
                self._reconnect()
            if not self.dead.is_set() and self.busy() and self.quiet():
                self._probe()
            self._overdue()
            self._stop.wait(self.interval_s())

    def quiet(self) -> bool:
        """Nothing heard on the main connection for an interval: a probe is due (a stream's chunks say the link is
        up as well as a probe would)."""
        return self.clock() - self.heard() >= self.interval_s()

    def _overdue(self) -> None:
        """A probe still out ``GRACE_S`` past its deadline: gRPC did not end it, so it is counted unanswered here."""
        now = self.clock()
        with self._lock:
            late = [(f, d, g) for f, (t, d, g) in self._pending.items() if now - t > d + GRACE_S]
            for future, _, _ in late:
                del self._pending[future]
        for future, deadline, generation in late:
            off_thread(future.cancel)
            self._mark_dead(f"heartbeat unanswered within {1000 * deadline:.0f} ms (no end from gRPC)", generation)

    def _probe(self) -> None:
        """Send one probe; its answer (or its failure) comes to ``_answered`` on a gRPC thread."""
        deadline, sent = self.deadline_s(), self.clock()
        with self._lock:  # not on a channel close() has closed
            if self._stop.is_set():
                return
            generation = self.generation
            future = self.stub.Probe.future(pb.ProbeRequest(), timeout=deadline)
            self._pending[future] = (sent, deadline, generation)
        future.add_done_callback(lambda f, d=deadline, g=generation, t=sent: self._answered(f, d, g, t))
        self.probes += 1

    def _answered(self, future: grpc.Future, deadline: float, generation: int, sent: float) -> None:
        with self._lock:
            if self._pending.pop(future, None) is None:
                return  # counted already (``_overdue``), or about a replaced connection
        if self._stop.is_set() or future.cancelled():
            return
        exc = future.exception()
        if exc is not None and self.heard() > sent + self.margin_s:
            return  # the server's stream went on arriving meanwhile: the probe queued behind it, the link is up
        if exc is not None:
            self._mark_dead(f"heartbeat unanswered within {1000 * deadline:.0f} ms ({exc.code().name})", generation)

    def _mark_dead(self, reason: str, generation: int) -> None:
        with self._lock:
            if self.dead.is_set() or generation != self.generation or self._fresh.is_set():
                return  # already known, or about a connection since replaced
            self.reason = reason
            self.dead.set()
        for callback in self._callbacks:
            callback(reason)
