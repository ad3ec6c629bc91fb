"""Link monitor: round-trip time and bandwidth, estimated from the client's own RPC timings.

The client needs to know its link to decide how much to draft per round and when the server is
gone. Every unary RPC is a free measurement: its wall time minus the compute the server reports
is network time, modelled as ``net = rtt + bytes_up / up_rate + bytes_down / down_rate``.
Small calls (most Verify rounds) measure the RTT; large ones (payloads, probes) the rates.
``probe`` measures deliberately when passive traffic is not enough (before the first round,
after a reconnect).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

RTT_GAIN = 1 / 8  # RFC 6298 alpha: SRTT follows RTT samples slowly, jitter alone does not move it
RTTVAR_GAIN = 1 / 4  # RFC 6298 beta
RATE_GAIN = 1 / 4  # bandwidth samples come rarely; a larger gain lets a few of them move the estimate
MIN_TRANSFER_BYTES = 32 * 1024  # below this (on an unknown link) a transfer hides in the RTT's jitter
MIN_TRANSFER_SHARE = 0.25  # a rate sample needs its transfer to be at least this share of the call
GAP_MIN_BYTES = 16 * 1024  # a stream's message timed by its arrival gap (observe_gap): at least this large...
GAP_FLOOR_S = 0.01  # ...and its transfer taken as at least this long (a quicker one bounds the rate from below)

PROBE_PINGS = 9  # a median of several: on a jittery link (4G: ±19 ms) a few pings say little
PROBE_REPEATS = 3  # transfers at the final size, for a median
PROBE_START_BYTES = 32 * 1024
PROBE_MAX_BYTES = 4 * 1024 * 1024
PROBE_TARGET_S = 0.08  # a transfer this long is timed well even with a few ms of jitter...
PROBE_JITTER_SPANS = 4  # ...and at least this many times the pings' spread, so jitter is a small part of it


def _ewma(old: float | None, sample: float, gain: float) -> float:
    return sample if old is None else old + gain * (sample - old)


def _mbps(bytes_per_s: float | None) -> float | None:
    return None if bytes_per_s is None else bytes_per_s * 8 / 1e6


class LinkMonitor:
    """Smoothed RTT (TCP style) and downlink/uplink rates in bytes/s; None until measured."""

    def __init__(self) -> None:
        self.srtt_s: float | None = None
        self.rttvar_s: float | None = None
        self.down_rate: float | None = None  # bytes per second, server -> client
        self.up_rate: float | None = None  # bytes per second, client -> server
        self.samples = 0  # observations accepted so far

    # --- passive: every RPC --------------------------------------------------------------------

    def transfer_s(self, bytes_up: int, bytes_down: int) -> float:
        """Predicted time to move these bytes at the current rates (0 for a direction not yet measured)."""
        up = bytes_up / self.up_rate if self.up_rate else 0.0
        down = bytes_down / self.down_rate if self.down_rate else 0.0
        return up + down

    def observe(self, wall_s: float, compute_s: float, bytes_up: int, bytes_down: int) -> bool:
        """Fold one RPC's timing into the estimates; returns False for a sample that makes no sense."""
        net = wall_s - compute_s
        if not (math.isfinite(net) and net > 0 and compute_s >= 0 and bytes_up >= 0 and bytes_down >= 0):
            return False
        # rates first, against the RTT known before this call; then the RTT, net of the predicted transfer
        down = self._rate_sample(net, bytes_down, self.down_rate, bytes_up, self.up_rate)
        up = self._rate_sample(net, bytes_up, self.up_rate, bytes_down, self.down_rate)
        if down is not None:
            self.down_rate = _ewma(self.down_rate, down, RATE_GAIN)
        if up is not None:
            self.up_rate = _ewma(self.up_rate, up, RATE_GAIN)
        rtt = net - self.transfer_s(bytes_up, bytes_down)
        if rtt > 0:  # <= 0: the rate estimates are too pessimistic for this call; its RTT is unknown
            self._rtt_sample(rtt)
        self.samples += 1
        return True

    def observe_gap(self, gap_s: float, compute_s: float, nbytes: int) -> None:
        """A reply stream's message of ``nbytes`` that arrived ``gap_s`` after a small one, with ``compute_s`` of server
        work between them: the rest of the gap is its transfer (a stream's first payload, which carries a prompt's
        features). One quicker than ``GAP_FLOOR_S`` still says the rate is at least ``nbytes / GAP_FLOOR_S``."""
        if nbytes >= GAP_MIN_BYTES and math.isfinite(gap_s - compute_s):
            self.down_rate = _ewma(self.down_rate, nbytes / max(gap_s - compute_s, GAP_FLOOR_S), RATE_GAIN)

    def _rtt_sample(self, rtt: float) -> None:
        """RFC 6298: the first sample sets SRTT and RTTVAR = R/2; later ones move them by fixed gains."""
        if self.srtt_s is None:
            self.srtt_s, self.rttvar_s = rtt, rtt / 2
            return
        self.rttvar_s += RTTVAR_GAIN * (abs(self.srtt_s - rtt) - self.rttvar_s)
        self.srtt_s += RTT_GAIN * (rtt - self.srtt_s)

    def _rate_sample(self, net: float, nbytes: int, rate: float | None, other_bytes: int, other_rate: float | None):
        """A rate sample (bytes/s) for one direction, or None when the transfer cannot be timed apart from the RTT."""
        if self.srtt_s is None or nbytes <= 0:
            return None
        if other_rate is None and other_bytes >= MIN_TRANSFER_BYTES:
            return None  # both directions large and one of them unknown: the time cannot be split
        predicted = nbytes / rate if rate else 0.0
        if nbytes < MIN_TRANSFER_BYTES and predicted < self.srtt_s:
            return None  # too small to time
        other_s = other_bytes / other_rate if other_rate else 0.0
        transfer = net - self.srtt_s - other_s
        floor = MIN_TRANSFER_SHARE * net
        if transfer < floor:
            if predicted < self.srtt_s:
                return None  # lost in the RTT's jitter
            transfer = floor  # far faster than believed: a bounded sample still moves the estimate up
        return nbytes / transfer

    # --- what the rest of the client reads -------------------------------------------------------

    def timeout_s(self, k: float = 4.0) -> float | None:
        """SRTT + k·RTTVAR: a call slower than this suggests the link is down (RFC 6298 uses k=4)."""
        return None if self.srtt_s is None else self.srtt_s + k * self.rttvar_s

    @property
    def rtt_ms(self) -> float | None:
        return None if self.srtt_s is None else self.srtt_s * 1e3

    @property
    def bandwidth_mbps(self) -> float | None:
        """Downlink in Mbit/s (1e6 bits/s), the direction verification payloads travel."""
        return _mbps(self.down_rate)

    @property
    def uplink_mbps(self) -> float | None:
        return _mbps(self.up_rate)

    def as_stats(self) -> dict[str, float | None]:
        return {"rtt_ms": self.rtt_ms, "bandwidth_mbps": self.bandwidth_mbps, "uplink_mbps": self.uplink_mbps}

    # --- active: a deliberate measurement ------------------------------------------------------

    def probe(
        self,
        call: Callable[[int, int, float], tuple[float, float]],
        budget_s: float = 1.5,
        max_bytes: int = PROBE_MAX_BYTES,
        clock: Callable[[], float] = time.perf_counter,
    ) -> dict[str, float | None]:
        """Measure RTT, then downlink, then uplink, within ``budget_s`` seconds.

        ``call(payload_bytes, reply_bytes, timeout_s) -> (wall_s, compute_s)`` makes one probe
        round trip and raises TimeoutError past ``timeout_s``, which ends the phase it is in.
        Pings give the RTT (median; they stop early once they have used a quarter of the budget).
        Each direction then doubles its transfer from 32 KB until one takes ``PROBE_TARGET_S`` and
        ``PROBE_JITTER_SPANS`` times the pings' spread (or
        reaches ``max_bytes``) and repeats it for a median; the downlink may use half of what is
        left. No call starts that is predicted to overrun. Medians replace the smoothed estimates:
        a probe is a deliberate measurement, not one noisy sample. Returns this probe's results
        (None for what it had no time to measure), its number of calls and its duration.
        """
        start = clock()
        deadline = start + budget_s
        calls = 0

        def net_s(payload_bytes: int, reply_bytes: int, predicted_s: float, until: float) -> float | None:
            nonlocal calls
            timeout_s = until - clock()
            if predicted_s > timeout_s:
                return None
            calls += 1
            try:
                wall, compute = call(payload_bytes, reply_bytes, timeout_s)
            except TimeoutError:
                return None
            net = wall - compute
            return net if math.isfinite(net) and net > 0 else None

        pings: list[float] = []
        while len(pings) < PROBE_PINGS and not (pings and clock() - start >= budget_s / 4):
            if (net := net_s(0, 0, self.srtt_s or 0.0, deadline)) is None:
                break
            pings.append(net)
        rtt = down = up = None
        if pings:
            rtt = statistics.median(pings)
            self.srtt_s, self.rttvar_s = rtt, statistics.fmean(abs(p - rtt) for p in pings)  # RTTVAR: their spread
            half = clock() + (deadline - clock()) / 2
            target_s = max(PROBE_TARGET_S, PROBE_JITTER_SPANS * (max(pings) - min(pings)))
            down = _probe_rate(lambda n, p: net_s(0, n, p, half), rtt, self.down_rate, max_bytes, target_s)
            up = _probe_rate(lambda n, p: net_s(n, 0, p, deadline), rtt, self.up_rate, max_bytes, target_s)
            self.down_rate, self.up_rate = down or self.down_rate, up or self.up_rate
        return {
            "rtt_ms": None if rtt is None else rtt * 1e3,
            "bandwidth_mbps": _mbps(down),
            "uplink_mbps": _mbps(up),
            "calls": calls,
            "elapsed_s": clock() - start,
        }


def _probe_rate(
    send: Callable[[int, float], float | None],
    rtt: float,
    rate: float | None,
    max_bytes: int,
    target_s: float = PROBE_TARGET_S,
) -> float | None:
    """One direction's rate (bytes/s): ramp the transfer up to a timeable size, then a median of a few at that size.

    ``send(nbytes, predicted_s)`` returns the call's network time, or None when it may not run.
    """
    size, transfers, previous = min(PROBE_START_BYTES, max_bytes), [], None
    while len(transfers) < PROBE_REPEATS:
        net = send(size, rtt + (size / rate if rate else 0.0))
        if net is None:
            break
        transfers.append(net - rtt)
        if transfers[-1] > 0:
            rate = size / transfers[-1]
        if len(transfers) == 1 and transfers[0] < target_s and size < max_bytes:  # too quick to time well
            previous, size, transfers = (size, transfers), min(2 * size, max_bytes), []
    if not transfers and previous:  # no time left for the larger size: settle for the last one timed
        size, transfers = previous
    transfer = statistics.median(transfers) if transfers else 0.0
    return size / transfer if transfer > 0 else None
