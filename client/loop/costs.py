"""What a round costs, as the client measures it: running fits of seconds against size (``LineFit``, and
``CostCurve`` for a verification by the tokens it verifies) and a Verify request's bytes on the wire. The adaptive
policy (``client.loop.adaptive``) decides with them."""

from __future__ import annotations

from dataclasses import dataclass, field

GAIN = 0.2  # weight of a new sample in the running averages


@dataclass
class LineFit:
    """Running least squares of y = a + b·x with exponential forgetting (the machine's speed drifts)."""

    forget: float = 0.95
    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def add(self, x: float, y: float) -> None:
        f = self.forget
        self.n, self.sx, self.sy = f * self.n + 1, f * self.sx + x, f * self.sy + y
        self.sxx, self.sxy = f * self.sxx + x * x, f * self.sxy + x * y

    def __call__(self, x: float, default: float) -> float:
        if self.n < 1:
            return default
        spread = self.n * self.sxx - self.sx**2
        if spread <= 1e-9 * max(1.0, self.n * self.sxx):  # one x value seen so far: the mean is all we know
            return self.sy / self.n
        b = max(0.0, (self.n * self.sxy - self.sx * self.sy) / spread)
        a = (self.sy - b * self.sx) / self.n
        return max(0.0, a + b * x)


@dataclass
class CostCurve:
    """Seconds of a verification by how many tokens it verifies: a running average per size measured, read between
    measured sizes by linear interpolation and beyond them by a running least-squares line. On a CPU the curve is
    convex — one token streams the weights, a few cost little more, then every token is arithmetic — so one line
    through all sizes would overprice small trees and underprice big ones."""

    line: LineFit = field(default_factory=LineFit)
    points: dict[int, float] = field(default_factory=dict)

    @property
    def n(self) -> float:
        return self.line.n

    def add(self, x: int, y: float) -> None:
        self.line.add(x, y)
        self.points[x] = y if x not in self.points else (1 - GAIN) * self.points[x] + GAIN * y

    def __call__(self, x: int, default: float) -> float:
        if x in self.points:
            return self.points[x]
        below = max((k for k in self.points if k < x), default=None)
        above = min((k for k in self.points if k > x), default=None)
        if below is not None and above is not None:
            share = (x - below) / (above - below)
            return self.points[below] + share * (self.points[above] - self.points[below])
        guess = self.line(x, default)  # outside what was measured: the line, never below a smaller size's cost
        return max(guess, self.points[below]) if below is not None else guess


def verify_request_bytes(nodes: int) -> int:
    """A Verify request's bytes on the wire for a tree of ``nodes``: ~55 for the session id, length and payload spec
    and ~3.7 a node (a token id's varint and a parent's), as serialised; rounded up."""
    return 64 + 4 * nodes
