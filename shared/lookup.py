"""Prompt lookup: draft by copying what followed an earlier occurrence of the current suffix.

One idea, two users: the client's ``prompt-lookup`` drafter (``client.drafters.prompt_lookup``) and the
server's own drafting inside a Decode stream (``DecodeRequest.lookup``: several tokens a forward where the
text repeats itself, with no round trip at all).

Training-free and nearly free to run, it shines when the output repeats the context (code
edits, summaries, quoting). We index every n-gram's end positions incrementally, so a proposal
is a dictionary lookup, not a scan of the context. With ``branches > 1`` the continuations of
several earlier occurrences are merged into a small tree (shared prefixes become one path). Where the text has no
match, the answers of earlier generations can be searched the same way (``past_tokens`` of them): an agent's requests
repeat tool calls and code across conversations, which the prompt of each does not hold (SuffixDecoding's idea, with
this n-gram index as its suffix structure).

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


PAST_TOKENS = 8192  # tokens of earlier generations' answers kept for lookup
SEPARATOR = -1  # between two past answers: no token id, so no n-gram spans it and no copy runs across it


class NgramLookup:
    """The n-gram index of a sequence and its proposals (a ``client.drafters.base.Drafter`` in all but name)."""

    def __init__(
        self, max_ngram: int = 3, min_ngram: int = 2, num_tokens: int = 10, branches: int = 1, adaptive: bool = True,
        past_tokens: int = 0,
    ):  # fmt: skip
        """``past_tokens``: how much of earlier generations' answers to keep for lookup (``PAST_TOKENS`` is a good
        size; 0, the default: none). Off by default: with it, a seeded sampled answer's draws follow drafts that
        depend on the requests before it, so the same request would no longer give the same text."""
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"expected 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if num_tokens < 1 or branches < 1:
            raise ValueError(f"num_tokens and branches must be >= 1, got {num_tokens}, {branches}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.num_tokens, self.branches, self.adaptive, self.past_tokens = num_tokens, branches, adaptive, past_tokens
        self.length = num_tokens
        self._proposed = 0  # depth of the last proposal, to see how much of it was kept
        self.history: list[int] = []
        self.index: dict[tuple[int, ...], list[int]] = defaultdict(list)
        self._answer = 0  # where this generation's own tokens start in ``history``
        # the answers of earlier generations, SEPARATOR between them, and their index: copied from where the text
        # has no match (an agent's tool calls, code it wrote for another request)
        self.past: list[int] = []
        self.past_index: dict[tuple[int, ...], list[int]] = defaultdict(list)

    def begin(self, tokens: list[int], features=None) -> None:
        """A new generation after ``tokens``; the last one's answer joins the past answers."""
        self.remember(self.history[self._answer :])
        self._restart(tokens)
        self._answer = max(len(tokens) - 1, 0)  # the last of them is the root, the answer's first token

    def _restart(self, tokens: list[int]) -> None:
        self.history = []
        self.index = defaultdict(list)
        self.length, self._proposed = self.num_tokens, 0
        self.absorb(tokens)

    def remember(self, answer: list[int]) -> None:
        """Keep ``answer`` among the past answers (the newest ``past_tokens`` tokens of them)."""
        if len(answer) <= self.min_ngram or not self.past_tokens:
            return
        past = self.past + [SEPARATOR] + list(answer) if self.past else list(answer)
        if len(past) > self.past_tokens:  # the oldest answers go, whole
            cut = len(past) - self.past_tokens  # the first token that fits; kept from the first answer whole after it
            if past[cut - 1] != SEPARATOR:
                cut = past.index(SEPARATOR, cut) + 1 if SEPARATOR in past[cut:] else len(past) - len(answer)
            self.past = past[cut:][-self.past_tokens :]
            self.past_index = defaultdict(list)
            _index(self.past, self.past_index, 0, self.min_ngram, self.max_ngram)
            return
        start = len(self.past)
        self.past = past
        _index(self.past, self.past_index, start, self.min_ngram, self.max_ngram)

    def absorb(self, tokens: list[int], features=None) -> None:
        if self.adaptive and self._proposed:
            kept = len(tokens) - 1
            self.length = min(self.num_tokens, self.length + 2) if kept >= self._proposed else max(1, self.length - 1)
        self._proposed = 0
        start = len(self.history)
        self.history.extend(tokens)
        _index(self.history, self.index, start, self.min_ngram, self.max_ngram)

    def rewind(self, n: int) -> None:
        answer = self._answer
        self._restart(self.history[: len(self.history) - n])
        self._answer = min(answer, len(self.history))

    def discard(self) -> None:
        self._proposed = 0  # its length adapts to verdicts only

    def propose(self, max_nodes: int, depth: int | None = None) -> DraftTree:
        """What followed the longest n-gram ending the text where it occurred before: in the text itself, else in the
        past answers."""
        tree = DraftTree()
        seen = self._continuations(self.history, self.index) or self._continuations(self.past, self.past_index)
        for continuation in seen:
            _merge(tree, continuation, max_nodes)
        self._proposed = max((len(c) for c in seen), default=0) if tree.tokens else 0
        return tree

    def _continuations(self, text: list[int], index: dict) -> list[tuple[int, ...]]:
        """Up to ``branches`` distinct continuations in ``text`` of the longest n-gram ending ``history``, newest
        first; none past a SEPARATOR."""
        end, length = len(self.history), self.length if self.adaptive else self.num_tokens
        for n in range(min(self.max_ngram, end), self.min_ngram - 1, -1):
            seen: list[tuple[int, ...]] = []
            for pos in reversed(index.get(tuple(self.history[end - n :]), ())):
                if text is self.history and pos == end:  # the suffix itself
                    continue
                continuation = tuple(text[pos : pos + length])
                if SEPARATOR in continuation:
                    continuation = continuation[: continuation.index(SEPARATOR)]
                if continuation and continuation not in seen:
                    seen.append(continuation)
                    if len(seen) == self.branches:
                        break
            if seen:
                return seen
        return []


def _index(text: list[int], index: dict, start: int, min_ngram: int, max_ngram: int) -> None:
    """Index the n-grams of ``text`` that end at positions past ``start`` (each n-gram -> the positions after it)."""
    for end in range(start + 1, len(text) + 1):
        for n in range(min_ngram, min(max_ngram, end) + 1):
            index[tuple(text[end - n : end])].append(end)


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
