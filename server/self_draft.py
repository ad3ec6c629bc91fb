"""The server's own drafting inside a Decode stream: prompt lookup over the session's tokens, as far as it pays.

A lookup's forward verifies the copied tokens with the next one; where the text repeats itself (code, quoting) it
yields several tokens for little more than a step, with no round trip. But a forward's cost grows with its tokens —
on a CPU whose kernels are compute-bound each one adds most of a step — so a copy that misses costs more than it
can gain. Every copy the lookup finds is scored against the tokens that come, verified or not, for the chance that
its i-th token is kept; a step copies as many tokens as maximise what it expects to yield per second by the
server's cost of a forward (none where the text does not repeat, or where a token costs nearly a step).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from shared.lookup import NgramLookup
from shared.tree import DraftTree

# Before any copy is scored, a copied token is taken to be kept 1 time in 2 (a Beta(1, 1) prior on each position):
# a lookup runs at once where rows are cheap (a GPU, a memory-bound forward), and waits for the text to show that it
# repeats where a row costs most of a step.
PRIOR_KEPT, PRIOR_SEEN = 1.0, 2.0


class SelfDraft:
    def __init__(self, tokens: list[int], max_tokens: int, costs: Callable[[], tuple[float, float] | None]):
        """``tokens``: the session's committed tokens (its last the root); ``max_tokens``: the longest copy;
        ``costs``: (a forward's fixed seconds, the seconds each of its tokens adds) now, None while unknown (then
        copies are whole)."""
        self.lookup = NgramLookup(num_tokens=max(1, max_tokens), adaptive=False)
        self.lookup.begin(list(tokens))
        self.costs = costs
        self.kept = np.zeros(max(1, max_tokens))  # kept[i]: scored copies whose first i + 1 tokens came
        self.seen = np.zeros(max(1, max_tokens))  # seen[i]: scored copies whose first i came and that had an i-th
        self.pending: list[tuple[int, DraftTree]] = []  # copies not yet scored: (where in the history, the copy)

    def propose(self, max_nodes: int) -> DraftTree:
        """The lookup's copy of at most ``max_nodes`` tokens, cut to the length that pays (an empty tree: a plain
        step)."""
        tree = self.lookup.propose(max_nodes)  # a chain: one earlier occurrence
        if not tree:
            return tree
        self.pending.append((len(self.lookup.history), tree))
        return tree.head(self.length(len(tree)))

    def length(self, longest: int) -> int:
        """How many of a ``longest``-token copy to verify: the k maximising (1 + expected tokens kept of the
        first k) / (seconds of a forward of k + 1 tokens); ties to the shorter."""
        costs = self.costs()
        if costs is None or sum(costs) <= 0:
            return longest
        fixed, per_token = costs
        chance = (self.kept[:longest] + PRIOR_KEPT) / (self.seen[:longest] + PRIOR_SEEN)  # i-th kept, those before it
        expected = 1 + np.concatenate(([0.0], np.cumsum(np.cumprod(chance))))
        seconds = fixed + per_token * np.arange(1, longest + 2)
        return int(np.argmax(expected / seconds))

    def observe(self, tokens: list[int]) -> None:
        """A step committed ``tokens``: score the copies they settle."""
        self.lookup.absorb(tokens)
        history, waiting = self.lookup.history, []
        for start, copy in self.pending:
            came = history[start : start + len(copy)]
            kept = len(copy.follow(came))
            if kept == len(came) < len(copy):
                waiting.append((start, copy))  # all it could be compared with matched: wait for more
                continue
            self.kept[:kept] += 1
            self.seen[: min(kept + 1, len(copy))] += 1
        self.pending = waiting
