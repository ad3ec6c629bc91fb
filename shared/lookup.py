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

A verified token is not free where the target's kernels are compute-bound (a CPU: a 10-token copy costs the 1.5B
2.4-4x a plain step), and on chat most copies miss at their first token. So every copy is scored against the tokens
that came after it, verified or not (``CopyRecord``): each copy carries the chance that each of its tokens is kept
(``DraftTree.kept``), and whoever knows the costs cuts it to the length that pays (``paying_length``): the client's
adaptive policy (``client.loop.sizing``), the server's self-draft (``server.self_draft``). With ``adaptive`` a copy
also runs only as far as its path is at least ``FLOOR`` likely kept, so that it says something for a static policy,
which sends what it is given; the record then learns the positions just past what has held.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from shared.tree import DraftTree, depths


def shared_length(a, b) -> int:
    """How many first tokens ``a`` and ``b`` have in common: how far a new prompt goes on from a sequence held (the
    server's prefix cache, a drafter's cache, the edge's choice of client for a conversation's next turn)."""
    n, end = 0, min(len(a), len(b))
    while n < end and a[n] == b[n]:
        n += 1
    return n


PAST_TOKENS = 8192  # tokens of earlier generations' answers kept for lookup
SEPARATOR = -1  # between two past answers: no token id, so no n-gram spans it and no copy runs across it
# Before any copy is scored, a copied token is taken to be kept 1 time in 2 (a Beta(1, 1) prior on each position):
# a copy runs whole at once where rows are cheap (a GPU, a memory-bound forward), and waits for the text to show that
# it repeats where a row costs most of a step
PRIOR_KEPT, PRIOR_SEEN = 1.0, 2.0
FLOOR = 0.05  # an adaptive lookup's copy ends before a token less likely than this to be kept with those before it


class CopyRecord:
    """How far copies held: each copy made is scored against the tokens that came after it, whether it was verified
    whole, cut or not sent at all, for the chance that its i-th token is kept once those before it were. Scoring the
    text rather than verdicts is what lets a copy cut to nothing still teach that the text has begun to repeat."""

    def __init__(self, longest: int):
        self.kept = np.zeros(max(1, longest))  # kept[i]: scored copies whose first i + 1 tokens came
        self.seen = np.zeros(max(1, longest))  # seen[i]: scored copies whose first i came and that had an i-th
        self.pending: list[tuple[int, DraftTree]] = []  # copies not yet scored: (where in the text, the copy)

    def made(self, start: int, copy: DraftTree) -> None:
        """A copy of what follows ``text[:start]``."""
        self.pending.append((start, copy))

    def settle(self, text: list[int]) -> None:
        """Score the copies ``text`` settles. A copy whose every token so far came waits for the rest."""
        waiting = []
        for start, copy in self.pending:
            came, levels = text[start : start + len(copy)], max(depths(copy.parents))
            kept = len(copy.follow(came))
            if kept == len(came) < levels:
                waiting.append((start, copy))
                continue
            self.kept[:kept] += 1
            self.seen[: min(kept + 1, levels)] += 1
        self.pending = waiting

    def chances(self, longest: int) -> np.ndarray:
        """The chance that a copy's i-th token is kept once those before it were, i < ``longest``."""
        return (self.kept[:longest] + PRIOR_KEPT) / (self.seen[:longest] + PRIOR_SEEN)


def paying_length(kept: Sequence[float], seconds: Sequence[float]) -> int:
    """How many of a copy's tokens to verify: the k maximising (1 + the chances of its first k tokens being kept,
    ``kept``, summed) / ``seconds[k]`` (a verification of the root and those k); ties to the shorter."""
    expected = 1 + np.concatenate(([0.0], np.cumsum(kept)))
    return int(np.argmax(expected / np.maximum(np.asarray(seconds[: len(expected)], dtype=float), 1e-12)))


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
        self.record = CopyRecord(num_tokens)
        self.history: list[int] = []
        self.index: dict[tuple[int, ...], list[int]] = defaultdict(list)
        self._answer = 0  # where this generation's own tokens start in ``history``
        # the answers of earlier generations, SEPARATOR between them, and their index: copied from where the text
        # has no match (an agent's tool calls, code it wrote for another request)
        self.past: list[int] = []
        self.past_index: dict[tuple[int, ...], list[int]] = defaultdict(list)

    def begin(self, tokens: list[int], features=None) -> None:
        """A new generation after ``tokens``; the last one's answer joins the past answers. How far copies held is
        the text's (a chat answer copies little, code quoting its prompt much): it goes on where ``tokens`` go on
        from the last generation's prompt (a conversation's next turn), and is learnt afresh for another text. Copies
        not yet scored go: the turn's template and the answer re-encoded may not read as they did."""
        if shared_length(tokens, self.history) < self._answer:
            self.record = CopyRecord(self.num_tokens)
        self.record.pending = []
        self.remember(self.history[self._answer :])
        self._restart(tokens)
        self._answer = max(len(tokens) - 1, 0)  # the last of them is the root, the answer's first token

    def _restart(self, tokens: list[int]) -> None:
        self.history = []
        self.index = defaultdict(list)
        self._extend(tokens)

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
        self._extend(tokens)
        self.record.settle(self.history)

    def assume(self, tokens: list[int]) -> None:
        """Tokens taken as committed before the target has seen them (drafting ahead): in the text, scoring no copy
        until they are (``rewind`` takes them back)."""
        self._extend(tokens)

    def _extend(self, tokens: list[int]) -> None:
        start = len(self.history)
        self.history.extend(tokens)
        _index(self.history, self.index, start, self.min_ngram, self.max_ngram)

    def rewind(self, n: int) -> None:
        answer, pending = self._answer, self.record.pending
        self._restart(self.history[: len(self.history) - n])
        self._answer = min(answer, len(self.history))
        self.record.pending = [(start, copy) for start, copy in pending if start <= len(self.history)]

    @property
    def length(self) -> int:
        """The longest copy: ``num_tokens``, or with ``adaptive`` as far as copies' paths stay ``FLOOR`` likely."""
        if not self.adaptive:
            return self.num_tokens
        return max(1, int(np.sum(np.cumprod(self.record.chances(self.num_tokens)) >= FLOOR)))

    def propose(self, max_nodes: int, depth: int | None = None) -> DraftTree:
        """What followed the longest n-gram ending the text where it occurred before: in the text itself, else in the
        past answers. A chain carries the chance that each of its tokens is kept (``DraftTree.kept``). A one-level
        call (an offline step: its token is committed as it is) is not scored: it would count itself as kept."""
        tree = DraftTree()
        seen = self._continuations(self.history, self.index) or self._continuations(self.past, self.past_index)
        for continuation in seen:
            _merge(tree, continuation, max_nodes)
        if tree.tokens and depth != 1:
            self.record.made(len(self.history), tree)
        if tree.tokens and len(seen) == 1:
            tree.kept = np.cumprod(self.record.chances(len(tree))).tolist()
        return tree

    def _continuations(self, text: list[int], index: dict) -> list[tuple[int, ...]]:
        """Up to ``branches`` distinct continuations in ``text`` of the longest n-gram ending ``history``, newest
        first; none past a SEPARATOR."""
        end, length = len(self.history), self.length
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
