"""Acceptance rules: which drafted tree nodes the target keeps, and the token it adds.

Both rules walk the tree from the root. Greedy keeps a child while it equals the target's
argmax. Sampling is lossless for trees of *deterministic* drafts (top-k children, not samples):
at each node try the children in order, accept child x with probability p(x) (the draft
probability is 1, so min(1, p/q) = p), on rejection set p(x) = 0 and renormalise; when every
child is rejected, sample the next token from what is left of p. The emitted tokens are then
distributed exactly as the target's own sampling (DESIGN.md §2).

A third rule, opt-in and *not* lossless: Medusa's typical acceptance (Cai et al. 2024, §2.3.1). A drafted token
is kept while the target finds it plausible, p(x) > min(ε, δ·exp(−H(p))) — a fixed bar ε for a confident target,
a lower one where its distribution is flat (high entropy H) — and the longest such path through the tree wins;
the token after it is drawn from p. It keeps more of a draft than exact sampling, at the price of emitting
tokens the target would not have sampled with those probabilities. At temperature 0 it is greedy, exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shared.tree import children

ACCEPTANCE = ("exact", "typical")  # the rules a sampled verification may follow (see the module docstring)
TYPICAL_EPSILON = 0.09  # Medusa's defaults for typical acceptance: the bar a confident target sets ...
TYPICAL_DELTA = 0.3  # ... and the scale of exp(-entropy) that lowers it where the target is unsure


@dataclass(frozen=True)
class SamplingParams:
    """How the target picks tokens. ``temperature == 0`` means greedy. ``acceptance`` is the rule drafts are
    judged by when sampling: ``exact`` (the target's distribution, lossless) or ``typical`` (with ``epsilon`` and
    ``delta``; not lossless)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    acceptance: str = "exact"
    epsilon: float = TYPICAL_EPSILON
    delta: float = TYPICAL_DELTA

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.acceptance not in ACCEPTANCE:
            raise ValueError(f"acceptance must be one of {', '.join(ACCEPTANCE)}, got {self.acceptance!r}")
        if not 0.0 < self.epsilon <= 1.0:
            raise ValueError(f"epsilon must be in (0, 1], got {self.epsilon}")
        if not self.delta >= 0.0:
            raise ValueError(f"delta must be >= 0, got {self.delta}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the target samples from: softmax(logits / T), cut to the top-p nucleus."""
    logits = logits.float()
    # subtract the max first: a tiny temperature must give a one-hot, not inf/inf = NaN
    probs = torch.softmax((logits - logits.amax(dim=-1, keepdim=True)) / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the token that crosses it included)
        outside = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def draw(p: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """A token drawn from ``p`` (weights over the vocabulary, not necessarily normalised) by inverting its cumulative
    sum at one uniform: exactly p's distribution, a token of weight 0 never, and over a 150k vocabulary ~8x cheaper
    than ``torch.multinomial`` (2.4 ms a draw here: a sampled plain-decoding step paid it every token)."""
    cdf = p.detach().double().cumsum(-1)
    u = torch.rand((), generator=generator, dtype=torch.float64, device=cdf.device) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), len(cdf) - 1)


def argmax(row: torch.Tensor) -> int:
    """The first index of the largest value (as torch's argmax). On a CPU through numpy: over a 49k vocabulary
    torch's costs several times numpy's, on a plain-decoding step of a few ms. Float first: bf16 is slow either way."""
    return argmaxes(row.reshape(1, -1))[0]


def argmaxes(rows: torch.Tensor) -> list[int]:
    """``argmax`` of each row of ``rows`` [R, V], read from a GPU in one transfer (row by row, a greedy walk waits
    on the GPU once a row)."""
    rows = rows.detach().float()
    return (rows.numpy().argmax(-1) if rows.device.type == "cpu" else rows.argmax(-1).cpu()).tolist()


def greedy_token(logits, row: int) -> int:
    """Row ``row``'s argmax. ``logits`` may know it already: ``shared.engine.target.TreeLogits.greedy``."""
    known = getattr(logits, "greedy", None)
    return known(row) if known is not None else argmax(logits[row])


def accept_tree(
    tokens: list[int],
    parents: list[int],
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> tuple[list[int], int]:
    """Apply the acceptance rule to a verified tree.

    ``logits`` has one row per position (a tensor, or anything indexed by row that computes rows on
    demand: ``shared.engine.target.TreeLogits``): row 0 is the target's prediction after the root, row i + 1
    its prediction after node i. Returns the accepted node indices (a root-to-leaf
    path, in order) and the bonus token the target adds after the last accepted node.
    """
    kids = children(parents)
    accepted: list[int] = []
    row = 0
    if params.acceptance == "typical" and not params.greedy:
        return _typical(tokens, kids, logits, params, generator)
    if params.greedy:
        while True:
            best = greedy_token(logits, row)
            match = next((c for c in kids[row] if tokens[c] == best), None)
            if match is None:
                return accepted, best
            accepted.append(match)
            row = match + 1
    while True:
        p = target_probs(logits[row].cpu(), params)
        match = None
        for c in kids[row]:
            x = tokens[c]
            if torch.rand((), generator=generator).item() < p[x].item():
                match = c
                break
            p[x] = 0.0
            total = p.sum()
            if total <= 0:  # every token with mass was drafted and rejected: numerically impossible but guarded
                p = target_probs(logits[row].cpu(), params)
                break
            p /= total
        if match is None:
            return accepted, draw(p, generator)
        accepted.append(match)
        row = match + 1


def _typical(tokens: list[int], kids: list[list[int]], logits, params: SamplingParams,
             generator: torch.Generator | None) -> tuple[list[int], int]:  # fmt: skip
    """Typical acceptance: the longest path of nodes the target finds plausible (the first of equals, in the
    drafter's order), and a draw from p after it."""
    probs: dict[int, torch.Tensor] = {}

    def p(row: int) -> torch.Tensor:
        if row not in probs:
            probs[row] = target_probs(logits[row].cpu(), params)
        return probs[row]

    def longest(row: int) -> list[int]:
        dist = p(row)
        entropy = -(dist * dist.clamp_min(1e-30).log()).sum().item()
        bar = min(params.epsilon, params.delta * math.exp(-entropy))
        best: list[int] = []
        for c in kids[row]:
            if dist[tokens[c]].item() > bar:
                path = [c] + longest(c + 1)
                if len(path) > len(best):
                    best = path
        return best

    accepted = longest(0)
    row = accepted[-1] + 1 if accepted else 0
    return accepted, draw(p(row), generator)
