"""How long the client waits for a call before it counts as lost: a bound for every call, from what was measured.

A call is bounded by the link's RTT bound (SRTT + 4·RTTVAR, as a TCP retransmission timer), its bytes at the
measured rates, ``SLACK`` times the server compute it is expected to take, and a floor — never more than the
verifier's cap (``rpc_timeout_s``), which is also the bound before the server's compute has been measured at all.
The compute comes from what the server's replies report (``compute_s``). A forward's cost grows with its tokens, so
two figures are kept: what a forward of a few tokens costs (a Verify, a streamed token) and what each token of a
forward of several costs (a tree, a prompt's prefill), each the decayed maximum of what was seen (a busier server's
batches make calls slower: the bound follows at once and relaxes slowly). A call is expected to cost the larger of
the two: on a GPU a prompt of 40 tokens costs about a step, on a CPU whose forwards are compute-bound (where a
17-token tree costs several steps) it costs 40 times a tree's token — the step alone would bound it at a fraction of
what it takes, and every such call would be lost. A tree's token includes its share of the step's fixed cost, so
the figure errs long for longer calls, never short. A stream is bounded per gap, the time between two of
its messages, so a stream of any length is watched as closely as one call.

A missed bound is a lost call (``client.net.remote``), which the decode loop handles as a cut: offline generation, then
the settlement. A call a few times slower than the server has ever been is not worth waiting for: a replica that
died behind a proxy that keeps the connection open answers no call ever, and nothing else would say so.
"""

from __future__ import annotations

from dataclasses import dataclass

from client.net.link import LinkMonitor

SMALL = 64  # tokens up to which a call is one forward of a few tokens
SLACK = 4.0  # times the compute a call is expected to take
FLOOR_S = 0.5  # no bound is shorter (a scheduler's hiccup, a garbage collection)
DECAY = 0.95  # what a high figure keeps per later observation
UNMEASURED_RTT_S = 1.0  # stands in for the RTT bound before the link has been measured
GRACE_S = 1.0  # a wait in this process outlasts gRPC's own deadline by this much before it abandons the call
ROUND_FLOOR_S = 0.1  # no drafted round's deadline is shorter
ROUND_MARGIN_S = 0.05  # a drafted round's deadline past its parts
PROBE_MARGIN_S = 0.05  # a Probe's bound past the RTT bound (as the heartbeat's: the server answers one at once)


@dataclass
class Bounds:
    """The server's measured compute, and the bound each kind of call gets from it and ``link``."""

    link: LinkMonitor
    cap_s: float = 120.0
    step_s: float | None = None  # a forward of at most SMALL tokens
    token_s: float | None = None  # a token of a forward of several

    def observe(self, tokens: int, compute_s: float) -> None:
        """A reply reported ``compute_s`` for a call that ran ``tokens`` tokens through the target."""
        if not compute_s > 0 or tokens < 1:
            return
        if tokens <= SMALL:
            self.step_s = compute_s if self.step_s is None else max(compute_s, DECAY * self.step_s)
        if tokens > 1:
            per = compute_s / tokens
            self.token_s = per if self.token_s is None else max(per, DECAY * self.token_s)

    def compute_s(self, tokens: int) -> float | None:
        """The compute a call of ``tokens`` tokens is expected to take; None before any was measured. Either figure
        stands in for the other: a token of a longer forward never costs more than a whole short forward."""
        if self.step_s is None and self.token_s is None:
            return None
        step = self.step_s if self.step_s is not None else SMALL * self.token_s
        if tokens <= 1:
            return step
        return max(step, tokens * (self.token_s if self.token_s is not None else step))

    def call_s(self, tokens: int = 1, up_bytes: int = 0, down_bytes: int = 0) -> float:
        """How long a call that runs ``tokens`` tokens and moves these bytes may take before it is lost."""
        compute = self.compute_s(tokens)
        if compute is None:
            return self.cap_s
        return min(self.cap_s, self.exchange_s(up_bytes, down_bytes) + SLACK * compute)

    def probe_s(self) -> float:
        """A Probe: no compute, answered at once even mid-verification, so only the RTT bound and a margin — asked
        after a call was lost, on a link that may be cut, it must not add a floor's worth of waiting."""
        rtt = self.link.timeout_s()
        return (UNMEASURED_RTT_S if rtt is None else rtt) + PROBE_MARGIN_S

    def exchange_s(self, up_bytes: int = 0, down_bytes: int = 0) -> float:
        """A call with no model compute (a Handshake, a Probe, a CloseSession, a payload fetched from the cache)."""
        rtt = self.link.timeout_s()
        rtt = UNMEASURED_RTT_S if rtt is None else rtt
        return min(self.cap_s, rtt + self.link.transfer_s(up_bytes, down_bytes) + FLOOR_S)


def round_s(link: LinkMonitor, compute_s: float, up_bytes: int, down_bytes: int) -> float:
    """A drafted round's deadline, before which a Verify is not presumed lost: the RTT bound (SRTT + 4·RTTVAR), 1.5x
    the compute it is expected to take, its bytes at the measured rates, and a margin. Tighter than ``Bounds.call_s``:
    the decode loop has what a round of this size costs from its own policy, and a cut noticed early is text written
    offline sooner."""
    rtt = link.timeout_s()
    rtt = UNMEASURED_RTT_S if rtt is None else rtt
    return max(ROUND_FLOOR_S, rtt + 1.5 * compute_s + link.transfer_s(up_bytes, down_bytes) + ROUND_MARGIN_S)
