"""What every trained drafter shares: drafting its own EAGLE-2 trees over cached, tree-masked nodes.

``TreeDrafter`` is a drafter that is its own ``TreeScorer``; ``DraftNodes`` keeps a tree's node
positions, cache slots and masks; ``causal_from`` masks committed tokens fed after a cache prefix.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field

import torch
from torch import nn

from client.drafters.base import Drafter
from client.drafters.tree_search import eagle2_tree
from shared.layers import node_mask
from shared.tree import DraftTree


class TreeDrafter(Drafter):
    """A drafter that is its own ``TreeScorer``: ``propose`` searches an EAGLE-2 tree of ``width`` x ``depth``."""

    def __init__(self, model: nn.Module, width: int = 4, depth: int = 5, name: str | None = None):
        self.model = model.eval()
        self.width, self.depth = width, depth
        self.name = name or model.kind
        self.features = model.features
        self.tli = model.parts.tli

    @property
    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def _dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @abstractmethod
    def can_draft(self) -> bool:
        """Whether there is enough context to draft from (otherwise ``propose`` returns an empty tree)."""

    def propose(self, max_nodes: int, depth: int | None = None) -> DraftTree:
        if max_nodes < 1 or not self.can_draft():
            return DraftTree()
        depth = self.depth if depth is None else depth
        tree, scores = eagle2_tree(self, self.width, depth, max_nodes, vocab_ids=self.model.parts.vocab_ids)
        tree.scores = scores
        return tree


@dataclass
class DraftNodes:
    """The draft nodes fed since a tree began, in feeding order: node i sits at cache slot ``first_slot + i``.

    Cache slots below ``first_slot`` hold the committed context (up to and including the root),
    which every node sees; beyond that a node sees only its ancestors and itself.
    """

    root: int  # the root's position: a node at depth k sits at position root + k
    first_slot: int
    parents: list[int] = field(default_factory=list)  # index of each node's parent, -1 for the root
    depths: list[int] = field(default_factory=list)

    def add(self, parents: list[int], device=None) -> tuple[list[int], int, torch.Tensor]:
        """Record new nodes; return their positions, the cache slot of the first, and their [1, n, slots] mask."""
        first = len(self.parents)
        self.parents += parents
        self.depths += [1 + (self.depths[p] if p >= 0 else 0) for p in parents]
        at = self.first_slot + first
        slots = list(range(self.first_slot, at + len(parents)))
        mask = node_mask(self.parents, len(parents), self.first_slot, slots, at + len(parents), device)
        return [self.root + d for d in self.depths[first:]], at, mask
