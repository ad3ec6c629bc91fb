"""How many of a tree's nodes are worth verifying when sessions share a forward.

A drafter sends its nodes best first (``head(k)`` is its best k-node tree), and verifying a
prefix-closed part of a tree is lossless: the acceptance rule holds for any tree, so the tokens are
the target's either way, only fewer of them may come per round. What a node costs depends on the
load. Alone, a forward is bound by reading the weights and 17 nodes cost little more than one; with
16 sessions in one forward on a CPU every token is arithmetic, and a tree's deep nodes, which are
rarely accepted, make all 16 sessions wait. So before each forward the batcher cuts its trees to the
common length k that maximises the tokens its sessions gain per second,

    sum over sessions s of (1 + A(min(k, n_s))) / (T(k) + o_s)

learnt from what the server served:

* A(j): nodes accepted from a tree's first j (over recent verifications: an accepted path keeps its
  nodes up to the first at index >= j, nodes being numbered parents first; exact for greedy acceptance);
* T: the forward's seconds, a least-squares fit a + b·tokens + c·(query·key pairs) over recent forwards;
* o_s: session s's time away from the server between its calls (drafting, the network).

Until it has seen enough of both it cuts nothing, except that T may start as a prior: the line the
engine's path timing drew through this machine's forwards (``Target.costs``), until the server has timed 32
of its own. A client's own policy cuts its tree for its link before sending it; this cut is the server's,
for its load.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

MIN_PATHS = 32  # verifications that reached a length before A of it is trusted
MIN_FORWARDS = 32  # forwards seen before the cost fit is trusted
REFIT_EVERY = 16


@dataclass(frozen=True)
class Tree:
    """A tree waiting in a forward: its nodes, the tokens already cached before it, its session's time away."""

    nodes: int
    context: int
    away_s: float = 0.0


class TreeBudget:
    def __init__(self, min_nodes: int = 1, paths: int = 512, forwards: int = 256,
                 prior: tuple[float, float] | None = None) -> None:  # fmt: skip
        """``min_nodes``: never cut a tree below this many nodes (a large number: never cut at all); ``prior``: a
        forward's (fixed seconds, seconds a token) until the fit, and where a fit is implausible."""
        self.min_nodes = min_nodes
        if prior is not None and min(prior) < 0:
            raise ValueError(f"prior {prior}: expected (fixed seconds, seconds a token), both >= 0")
        self._prior = None if prior is None else np.array([prior[0], prior[1], 0.0])
        self._paths: deque[tuple[int, np.ndarray]] = deque(maxlen=paths)
        self._lead = np.zeros(1)  # _lead[j]: sum over recorded paths of nodes accepted from the first j
        self._reach = np.zeros(1, dtype=np.int64)  # _reach[j]: recorded trees with at least j nodes
        self._forwards: deque[tuple[float, float, float]] = deque(maxlen=forwards)
        self._coef: np.ndarray | None = self._prior
        self._bound = False  # recent forwards compute-bound (see compute_bound)
        self._unfitted = 0

    def observe_path(self, nodes: int, accepted: list[int]) -> None:
        """A verified tree of ``nodes`` nodes whose accepted path was ``accepted`` (node indices, root to leaf)."""
        if len(self._paths) == self._paths.maxlen:
            self._count(*self._paths[0], sign=-1)
        record = (nodes, np.asarray(accepted, dtype=np.int64))
        self._paths.append(record)
        self._count(*record, sign=1)

    def _count(self, nodes: int, path: np.ndarray, sign: int) -> None:
        if nodes + 1 > len(self._lead):
            self._lead = np.pad(self._lead, (0, nodes + 1 - len(self._lead)))
            self._reach = np.pad(self._reach, (0, nodes + 1 - len(self._reach)))
        self._lead[: nodes + 1] += sign * np.searchsorted(path, np.arange(nodes + 1))
        self._reach[: nodes + 1] += sign

    def accepted(self, j: int) -> float | None:
        """Mean nodes accepted from a tree's first ``j``; None until enough trees of that size were seen."""
        if j >= len(self._reach) or self._reach[j] < MIN_PATHS:
            return None
        return float(self._lead[j] / self._reach[j])

    def observe_forward(self, tokens: int, pairs: int, seconds: float) -> None:
        """A forward of ``tokens`` tokens and ``pairs`` query·key pairs took ``seconds``."""
        self._forwards.append((float(tokens), float(pairs), seconds))
        self._unfitted += 1
        if self._unfitted >= REFIT_EVERY and len(self._forwards) >= MIN_FORWARDS:
            self._unfitted = 0
            data = np.array(self._forwards)
            x = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
            coef = np.linalg.lstsq(x, data[:, 2], rcond=None)[0]
            plausible = (coef >= 0).all() and coef[1] > 0
            self._coef = coef if plausible else self._prior  # no prior either: cut nothing
            recent = data[-REFIT_EVERY:]
            self._bound = plausible and float(coef[1:] @ recent[:, :2].mean(axis=0)) >= coef[0]

    def seconds(self, tokens: float, pairs: float) -> float | None:
        """The fitted cost of a forward (the prior's before the fit); None before there is either."""
        return None if self._coef is None else float(self._coef @ [1.0, tokens, pairs])

    def costs(self, context: int) -> tuple[float, float] | None:
        """(fixed seconds of a forward, marginal seconds of one more token in it at ``context``) from the fit
        (or the prior); None before there is either."""
        if self._coef is None:
            return None
        a, b, c = self._coef
        return float(a), float(b + c * context)

    def compute_bound(self) -> bool:
        """Do recent forwards spend more on their tokens than on reading the weights? Then every token added
        slows every session in the forward: the server is busy, whatever its batch size. (Judged at each refit.)"""
        return self._bound

    def choose(self, trees: list[Tree], tokens: int, pairs: int) -> int | None:
        """The common length to cut ``trees`` to, or None to verify them whole. ``tokens`` and ``pairs``: the
        rest of the forward (other steps: prompt pieces, decode steps)."""
        if not trees or self._coef is None:
            return None
        longest = max(t.nodes for t in trees)
        if any(self.accepted(t.nodes) is None for t in trees):
            return None  # what the trees would gain whole is not known yet
        best, best_rate = None, -1.0
        for k in range(min(self.min_nodes, longest), longest + 1):
            gained = [self.accepted(min(k, t.nodes)) for t in trees]
            if None in gained:
                continue
            sizes = [min(k, t.nodes) + 1 for t in trees]  # + the root
            attended = sum(n * (t.context + n) for n, t in zip(sizes, trees, strict=True))
            seconds = self.seconds(tokens + sum(sizes), pairs + attended)
            rate = sum((1 + g) / (seconds + t.away_s) for g, t in zip(gained, trees, strict=True))
            if rate > best_rate:
                best, best_rate = k, rate
        return None if best is None or best >= longest else best
