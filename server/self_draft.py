"""The server's own drafting inside a Decode stream: prompt lookup over the session's tokens, as far as it pays.

A lookup's forward verifies the copied tokens with the next one; where the text repeats itself (code, quoting) it
yields several tokens for little more than a step, with no round trip. But a forward's cost grows with its tokens —
on a CPU whose kernels are compute-bound each one adds most of a step — so a copy that misses costs more than it
can gain. Every copy the lookup finds is scored against the tokens that come, verified or not, for the chance that
its i-th token is kept (``shared.lookup.CopyRecord``, as the client's copies are); a step copies as many tokens as
maximise what it expects to yield per second by the server's cost of a forward (none where the text does not repeat,
or where a token costs nearly a step).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from shared.lookup import NgramLookup, paying_length
from shared.tree import DraftTree


class SelfDraft:
    def __init__(self, tokens: list[int], max_tokens: int, costs: Callable[[], tuple[float, float] | None]):
        """``tokens``: the session's committed tokens (its last the root); ``max_tokens``: the longest copy;
        ``costs``: (a forward's fixed seconds, the seconds each of its tokens adds) now, None while unknown (then
        copies are whole)."""
        self.lookup = NgramLookup(num_tokens=max(1, max_tokens), adaptive=False)
        self.lookup.begin(list(tokens))
        self.costs = costs

    def propose(self, max_nodes: int) -> DraftTree:
        """The lookup's copy of at most ``max_nodes`` tokens, cut to the length that pays (an empty tree: a plain
        step)."""
        tree = self.lookup.propose(max_nodes)  # a chain: one earlier occurrence
        costs = self.costs()
        if not tree or costs is None or sum(costs) <= 0:
            return tree
        fixed, per_token = costs
        return tree.head(paying_length(tree.kept, fixed + per_token * np.arange(1, len(tree) + 2)))

    def observe(self, tokens: list[int]) -> None:
        """A step committed ``tokens``: score the copies they settle."""
        self.lookup.absorb(tokens)
