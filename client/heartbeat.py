"""Knowing the link is dead within about two round trips, whatever the server is busy with.

A Verify's own deadline has to allow for the server's compute (a tree on a big target takes a
while), so by itself it notices a silent cut late. The heartbeat asks a different question: empty
Probe calls, every half round trip, each with a deadline of one RTT bound (SRTT + 4·RTTVAR, as a
TCP retransmission timer) plus a margin. The server answers them at once even mid-Verify. The first
one unanswered marks the link dead and fires the callbacks (the decode loop cancels its Verify and
generates locally); a cut is thus noticed within interval + deadline, about 2 x RTT + 50 ms.

gRPC's own keepalive pings cannot do this: gRPC core sends at most one per second.

The probes travel on a connection of their own (a local subchannel pool), so they never queue behind
a large payload on the main connection and cannot delay it; while the link is marked dead no probes
are sent (the reconnection poll takes over) until ``revive``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import grpc

from client.link import LinkMonitor
from shared.wire import splitspec_pb2 as pb
from shared.wire import splitspec_pb2_grpc as pb_grpc

MIN_INTERVAL_S = 0.025
MARGIN_S = 0.05
UNMEASURED_DEADLINE_S = 1.0  # before the link has an RTT estimate


class Heartbeat:
    """Probes ``address`` on its own connection while alive; ``dead`` is set at the first unanswered one."""

    def __init__(self, address: str, link: LinkMonitor, min_interval_s: float = MIN_INTERVAL_S,
                 margin_s: float = MARGIN_S):  # fmt: skip
        self.link, self.min_interval_s, self.margin_s = link, min_interval_s, margin_s
        options = [
            ("grpc.use_local_subchannel_pool", 1),  # a TCP connection of its own, not the Verify one
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 500),
        ]
        self.channel = grpc.insecure_channel(address, options=options)
        self.stub = pb_grpc.SplitSpecStub(self.channel)
        self.dead = threading.Event()
        self.reason = ""
        self.probes = 0
        self._callbacks: list[Callable[[str], None]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="splitspec-heartbeat")

    def on_dead(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` (from a gRPC or heartbeat thread) each time the link is found dead."""
        self._callbacks.append(callback)

    def interval_s(self) -> float:
        return max(self.min_interval_s, (self.link.srtt_s or 0.0) / 2)

    def deadline_s(self) -> float:
        bound = self.link.timeout_s()
        return (UNMEASURED_DEADLINE_S if bound is None else bound) + self.margin_s

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def revive(self) -> None:
        """The link works again (the caller has just talked to the server): resume probing."""
        with self._lock:
            self.dead.clear()
            self.reason = ""

    def close(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout=1.0)
        self.channel.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.dead.is_set():
                deadline = self.deadline_s()
                future = self.stub.Probe.future(pb.ProbeRequest(), timeout=deadline)
                future.add_done_callback(lambda f, d=deadline: self._answered(f, d))
                self.probes += 1
            self._stop.wait(self.interval_s())

    def _answered(self, future: grpc.Future, deadline: float) -> None:
        if self._stop.is_set() or future.cancelled():
            return
        exc = future.exception()
        if exc is None:
            return
        reason = f"heartbeat unanswered within {1000 * deadline:.0f} ms ({exc.code().name})"
        with self._lock:
            if self.dead.is_set():
                return
            self.reason = reason
            self.dead.set()
        for callback in self._callbacks:
            callback(reason)
