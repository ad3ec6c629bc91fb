"""EAGLE-2 dynamic draft trees, for any drafter model that can score a batch of tree nodes.

A fixed tree shape wastes nodes: after an easy token the drafter is sure and one deep chain
would do, after a hard one several siblings are worth a try. EAGLE-2 (Li et al., 2024) lets the
drafter's own confidence choose the shape every round. It rests on one observation: for a
reasonably calibrated drafter, the probability of a path (the product of its per-step
probabilities, i.e. the *cumulative log-probability*) tracks how likely the target is to accept
the whole path. So the search is:

1. *Expand.* Depth 1 holds the root's top-``width`` tokens. At every further depth the
   ``width`` best nodes of the previous depth (the *frontier*, ranked by cumulative score) are
   fed to the drafter in one batch; each proposes its top-``width`` children, and the best
   ``width`` of those ``width**2`` become the next frontier. One drafter call per depth, and
   nodes outside the frontier are never fed.
2. *Rerank.* Every candidate ever scored, fed or not, competes for the ``max_nodes`` slots by
   cumulative score. A child never outscores its parent (log-probabilities are <= 0, and ties go
   to the shallower node), so the kept set is always a tree.

The result comes back in rank order, which is also a parents-first order. Its first k nodes are
exactly the tree that ``max_nodes=k`` would give, so a caller may cut it short freely.

Shortcut: expanding the frontier only adds nodes that score at most the frontier's best. Once
``max_nodes`` candidates exist and the best frontier score is no better than the
``max_nodes``-th best candidate, no deeper node can make the cut, so the search stops and saves
the remaining drafter calls (with ``max_nodes=1`` it never calls ``expand``). Note that
``max_nodes <= width`` alone does *not* allow stopping at depth 1: a near-certain child of the
best root child can outscore the second-best root child.
"""

from __future__ import annotations

import heapq
import math
from typing import Protocol

import torch

from shared.tree import ROOT, DraftTree

_LOGPROB_SLACK = 1e-3  # rounding may push a log-probability of ~1 slightly above 0; more than this is a bug


class TreeScorer(Protocol):
    """A drafter model as the tree search sees it: next-token log-probabilities for the root and for tree nodes."""

    def root_logprobs(self) -> torch.Tensor:
        """Log-probabilities [V] of the token after the root (the newest committed token).

        Called once per tree, before anything else; the model may process pending committed tokens here.
        """
        ...

    def expand(self, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """Feed n new draft nodes in one batch and return log-probabilities [n, V] of each one's next token.

        ``parents[i]`` is the index of node i's parent among all draft nodes fed so far in this tree
        (in feeding order), or -1 for the root. Each node attends to the committed context and its ancestors only.
        """
        ...

    def end_tree(self) -> None:
        """Forget every draft node fed since ``root_logprobs`` (rewind the model's draft state)."""
        ...


def eagle2_tree(
    scorer: TreeScorer,
    width: int,
    depth: int,
    max_nodes: int,
    vocab_mask: torch.Tensor | None = None,
    vocab_ids: torch.Tensor | None = None,
    floor: float = 0.0,
) -> tuple[DraftTree, list[float]]:
    """Build an EAGLE-2 draft tree; return it with each node's cumulative log-probability, in rank order.

    ``floor``: stop going deeper once the best path of the frontier is less likely than this (a probability):
    a drafter step whose best outcome is that unlikely costs more than it can gain (0: always ``depth`` deep).

    ``vocab_mask`` (bool [V], True = may be drafted) keeps tokens out of the tree without renormalising the
    drafter's probabilities. Tokens of probability zero are never drafted, so the tree may be smaller than
    ``max_nodes``. ``scorer.end_tree()`` is always called, also when the search fails. With a pruned draft
    vocabulary the scorer's log-probabilities index it and ``vocab_ids`` [V] maps each index to its token id:
    ``expand`` and the tree then see token ids.
    """
    for name, value in (("width", width), ("depth", depth), ("max_nodes", max_nodes)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    try:
        return _search(scorer, width, depth, max_nodes, vocab_mask, vocab_ids, floor)
    finally:
        scorer.end_tree()


def chain_draft(scorer: TreeScorer, length: int) -> DraftTree:
    """A single greedy chain of ``length`` tokens: the EAGLE-2 tree of width 1."""
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    tree, _ = eagle2_tree(scorer, width=1, depth=length, max_nodes=length)
    return tree


def _search(
    scorer: TreeScorer,
    width: int,
    depth: int,
    max_nodes: int,
    vocab_mask: torch.Tensor | None,
    vocab_ids: torch.Tensor | None,
    floor: float = 0.0,
) -> tuple[DraftTree, list[float]]:
    lowest = math.log(floor) if floor > 0 else -math.inf
    # Every candidate ever scored, as parallel lists indexed by candidate number (parents come first).
    tokens: list[int] = []
    parents: list[int] = []  # candidate number of the parent, or ROOT
    scores: list[float] = []  # cumulative log-probability of the path root -> node
    levels: list[int] = []  # depth, 1 for the root's children
    fed: dict[int, int] = {}  # candidate number -> index among the nodes fed to the scorer
    blocked = None if vocab_mask is None else ~vocab_mask.to(torch.bool)

    def add_children(logprobs: torch.Tensor, frontier: list[int]) -> list[int]:
        """Add the top-``width`` children of each frontier node (``ROOT`` for the root); return them best first."""
        if blocked is not None:
            logprobs = logprobs.masked_fill(blocked.to(logprobs.device), -math.inf)
        values, ids = logprobs.topk(min(width, logprobs.shape[-1]), dim=-1)
        if vocab_ids is not None:
            ids = vocab_ids[ids.to(vocab_ids.device)]  # the scorer's device need not be the vocabulary's
        new: list[int] = []
        for parent, row_values, row_ids in zip(frontier, values.tolist(), ids.tolist(), strict=True):
            base, level = (0.0, 1) if parent == ROOT else (scores[parent], levels[parent] + 1)
            for logprob, token in zip(row_values, row_ids, strict=True):
                if not logprob <= _LOGPROB_SLACK:  # also catches NaN
                    raise ValueError(f"scorer returned {logprob} for token {token}; expected log-probabilities <= 0")
                if logprob == -math.inf:
                    break  # topk is sorted: the rest of the row is impossible too
                new.append(len(tokens))
                tokens.append(token)
                parents.append(parent)
                scores.append(base + min(logprob, 0.0))  # <= 0 keeps every child ranked below its parent
                levels.append(level)
        return sorted(new, key=lambda i: -scores[i])  # stable: ties stay in parent-then-child order

    frontier = add_children(scorer.root_logprobs().reshape(1, -1), [ROOT])[:width]
    for _ in range(2, depth + 1):
        if not frontier or scores[frontier[0]] < lowest or _settled(scores, scores[frontier[0]], max_nodes):
            break
        feed_parents = [ROOT if parents[i] == ROOT else fed[parents[i]] for i in frontier]
        for i in frontier:
            fed[i] = len(fed)
        logprobs = scorer.expand([tokens[i] for i in frontier], feed_parents)
        if logprobs.dim() != 2 or logprobs.shape[0] != len(frontier):
            raise ValueError(f"expand returned shape {tuple(logprobs.shape)} for {len(frontier)} nodes, not [n, V]")
        frontier = add_children(logprobs, frontier)[:width]

    # By (score desc, depth asc) a child never precedes its parent: the top max_nodes form a tree, parents first.
    ranked = sorted(range(len(tokens)), key=lambda i: (-scores[i], levels[i]))[:max_nodes]
    new_index = {old: new for new, old in enumerate(ranked)}
    tree = DraftTree()
    for i in ranked:
        tree.add(tokens[i], ROOT if parents[i] == ROOT else new_index[parents[i]])
    return tree, [scores[i] for i in ranked]


def _settled(scores: list[float], best_frontier_score: float, max_nodes: int) -> bool:
    """True when no descendant of the frontier can enter the final top ``max_nodes``.

    Descendants score at most ``best_frontier_score`` and are deeper than every candidate so far, so on a tie
    they rank below it: they cannot displace the current ``max_nodes``-th best.
    """
    return len(scores) >= max_nodes and best_frontier_score <= heapq.nlargest(max_nodes, scores)[-1]
