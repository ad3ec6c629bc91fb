"""The server's own drafting inside a Decode stream: prompt lookup over the session's tokens, used while it pays.

A lookup's forward verifies the copied tokens with the next one; where the text repeats itself (code, quoting) it
yields several tokens for little more than a step, with no round trip. On a CPU a forward's cost grows fast with its
tokens (int8 kernels: 4 tokens cost ~2x a step), so a miss is not free: each kind of step is timed per token it
yields, lookups run while theirs beat plain steps', and are tried again every ``RETRY`` matches otherwise.
"""

from __future__ import annotations

from shared.lookup import NgramLookup
from shared.tree import DraftTree

RETRY = 16  # matches passed over before a lookup that was not paying is tried again
GAIN = 0.2  # weight of a new step in the running seconds per token


class SelfDraft:
    def __init__(self, tokens: list[int], max_tokens: int):
        """``tokens``: the session's committed tokens (its last the root); ``max_tokens``: the longest copy."""
        self.lookup = NgramLookup(num_tokens=max(1, max_tokens))
        self.lookup.begin(list(tokens))
        self.per_token: dict[bool, float | None] = {True: None, False: None}  # seconds per token, drafted or not
        self.passed = 0  # matches passed over since the last lookup

    def propose(self, max_nodes: int) -> DraftTree:
        """The lookup's draft of at most ``max_nodes`` tokens, or an empty tree while lookups lose to plain steps."""
        tree = self.lookup.propose(max_nodes)
        drafted, plain = self.per_token[True], self.per_token[False]
        if not tree or drafted is None or plain is None or drafted <= plain or self.passed >= RETRY:
            self.passed = 0
            return tree
        self.passed += 1
        self.lookup.discard()
        return DraftTree()

    def observe(self, drafted: bool, tokens: list[int], seconds: float) -> None:
        """A step's outcome: it verified a draft (``drafted``) and committed ``tokens`` in ``seconds``."""
        self.lookup.absorb(tokens)
        old, sample = self.per_token[drafted], seconds / max(1, len(tokens))
        self.per_token[drafted] = sample if old is None else old + GAIN * (sample - old)
