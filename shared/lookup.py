"""Prompt lookup: draft by copying what followed an earlier occurrence of the current suffix.

One idea, two users: the client's ``prompt-lookup`` drafter (``client.drafters.prompt_lookup``) and the
server's own drafting inside a Decode stream (``DecodeRequest.lookup``: several tokens a forward where the
text repeats itself, with no round trip at all).

Training-free and nearly free to run, it shines when the output repeats the context (code
edits, summaries, quoting). We index every n-gram's end positions incrementally, so a proposal
is a dictionary lookup, not a scan of the context. With ``branches > 1`` the continuations of
several earlier occurrences are merged into a small tree (shared prefixes become one path).

On a CPU a verified token is not free (a 10-token draft costs the target ~1.7x a plain step), so
with ``adaptive`` the copy length follows the acceptance seen so far: +2 after a fully accepted
draft, -1 otherwise (transformers' schedule for assistant models), between 1 and ``num_tokens``.
"""

from __future__ import annotations

from collections import defaultdict

from shared.tree import DraftTree


def shared_length(a, b) -> int:
    """How many first tokens ``a`` and ``b`` have in common: how far a new prompt goes on from a sequence held (the
    server's prefix cache, a drafter's cache, the edge's choice of client for a conversation's next turn)."""
    n, end = 0, min(len(a), len(b))
    while n < end and a[n] == b[n]:
        n += 1
    return n


class NgramLookup:
    """The n-gram index of a sequence and its proposals (a ``client.drafters.base.Drafter`` in all but name)."""

    def __init__(
        self, max_ngram: int = 3, min_ngram: int = 2, num_tokens: int = 10, branches: int = 1, adaptive: bool = True
    ):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"expected 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if num_tokens < 1 or branches < 1:
            raise ValueError(f"num_tokens and branches must be >= 1, got {num_tokens}, {branches}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.num_tokens, self.branches, self.adaptive = num_tokens, branches, adaptive
        self.length = num_tokens
        self._proposed = 0  # depth of the last proposal, to see how much of it was kept
        self.history: list[int] = []
        self.index: dict[tuple[int, ...], list[int]] = defaultdict(list)

    def begin(self, tokens: list[int], features=None) -> None:
        self.history = []
        self.index = defaultdict(list)
        self.length, self._proposed = self.num_tokens, 0
        self.absorb(tokens)

    def absorb(self, tokens: list[int], features=None) -> None:
        if self.adaptive and self._proposed:
            kept = len(tokens) - 1
            self.length = min(self.num_tokens, self.length + 2) if kept >= self._proposed else max(1, self.length - 1)
        self._proposed = 0
        for token in tokens:
            self.history.append(token)
            end = len(self.history)
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self.index[tuple(self.history[end - n : end])].append(end)

    def rewind(self, n: int) -> None:
        self.begin(self.history[: len(self.history) - n])

    def discard(self) -> None:
        self._proposed = 0  # its length adapts to verdicts only

    def propose(self, max_nodes: int, depth: int | None = None) -> DraftTree:
        tree = DraftTree()
        end = len(self.history)
        for n in range(min(self.max_ngram, end), self.min_ngram - 1, -1):
            seen: set[tuple[int, ...]] = set()
            for pos in reversed(self.index.get(tuple(self.history[end - n :]), ())):
                if pos == end:  # the suffix itself
                    continue
                continuation = tuple(self.history[pos : pos + (self.length if self.adaptive else self.num_tokens)])
                if continuation and continuation not in seen:
                    seen.add(continuation)
                    _merge(tree, continuation, max_nodes)
                    if len(seen) == self.branches:
                        break
            if seen:
                break
        self._proposed = max((len(c) for c in seen), default=0) if tree.tokens else 0
        return tree


def _merge(tree: DraftTree, path: tuple[int, ...], max_nodes: int) -> None:
    """Add ``path`` below the root, reusing nodes that already spell its prefix."""
    parent = -1
    for token in path:
        pairs = enumerate(zip(tree.tokens, tree.parents, strict=True))
        node = next((i for i, (t, p) in pairs if p == parent and t == token), None)
        if node is None:
            if len(tree) >= max_nodes:
                return
            node = tree.add(token, parent)
        parent = node
