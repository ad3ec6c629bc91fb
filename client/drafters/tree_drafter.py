"""What every trained drafter shares: drafting its own EAGLE-2 trees over cached, tree-masked nodes.

``TreeDrafter`` is a drafter that is its own ``TreeScorer``; ``DraftNodes`` keeps a tree's node
positions, cache slots and masks; ``TokenCache`` is the cache bookkeeping of a drafter that reads only tokens.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field

import torch
from torch import nn

from client.drafters.base import DRAFT_PRECISIONS, Drafter
from client.drafters.tree_search import eagle2_tree
from shared.payload import PayloadSpec
from shared.tree import DraftTree, causal_from, depths, node_mask


class TreeDrafter(Drafter):
    """A drafter that is its own ``TreeScorer``: ``propose`` searches an EAGLE-2 tree of ``width`` x ``depth``."""

    def __init__(self, model: nn.Module, width: int = 4, depth: int = 5, name: str | None = None):
        self.model = model.eval()
        self.width, self.depth = width, depth
        self.name = name or model.kind
        self.tli = model.parts.tli

    def payload_specs(self, precisions: tuple[str, ...] = DRAFT_PRECISIONS) -> list[PayloadSpec]:
        """The model's payload forms (``payload_forms``) in each precision; form lsa only with a bundle the
        server can load (it runs that bundle's LSA), carrying the last ``tli`` layers' KV as well."""
        modes = [m for m in self.model.payload_forms if m != "lsa" or self.bundle is not None]
        return [PayloadSpec(m, p, self.tli if m == "lsa" else 0, self.name if m == "lsa" else "")
                for m in modes for p in precisions]  # fmt: skip

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

    def add(self, parents: list[int], device=None) -> tuple[list[int], int, torch.Tensor]:
        """Record new nodes; return their positions, the cache slot of the first, and their [1, n, slots] mask."""
        first = len(self.parents)
        self.parents += parents
        at = self.first_slot + first
        slots = list(range(self.first_slot, at + len(parents)))
        mask = node_mask(self.parents, len(parents), self.first_slot, slots, at + len(parents), device)
        return [self.root + d for d in depths(self.parents)[first:]], at, mask


class TokenCache:
    """What a drafter reading only tokens does with its KV cache (the independent drafter, a whole model): committed
    tokens are fed once, lazily, when a tree starts; the root is fed again each tree (its output is what drafts); a
    tree's nodes take the slots after the root and the next tree overwrites them, so accepted drafts are fed again as
    committed tokens. The drafter supplies ``_logprobs`` and ``_device``; ``clear_tokens`` starts a sequence."""

    tokens: list[int]

    def clear_tokens(self) -> None:
        self.tokens = []
        self.fed = 0  # committed tokens already in the cache
        self.nodes = DraftNodes(0, 0)

    def absorb(self, tokens: list[int], features=None) -> None:
        self.tokens += tokens  # the target's features are of no use here

    def assume(self, tokens: list[int]) -> None:
        self.absorb(tokens)  # tokens are all it reads: nothing to stand in for

    def rewind(self, n: int) -> None:
        if n > 0:
            self.tokens = self.tokens[:-n]
            self.fed = min(self.fed, len(self.tokens))

    @abstractmethod
    def _logprobs(self, tokens: list[int], positions: list[int], mask: torch.Tensor | None, at: int) -> torch.Tensor:
        """Log-probabilities [n, V] after feeding ``tokens`` at ``positions`` into cache slots from ``at``."""

    @torch.inference_mode()
    def root_logprobs(self) -> torch.Tensor:
        root = len(self.tokens) - 1
        start = min(self.fed, root)
        n = root + 1 - start
        self.fed = root + 1
        self.nodes = DraftNodes(root, root + 1)
        return self._logprobs(self.tokens[start:], list(range(start, root + 1)), causal_from(start, n, self._device),
                              start)[-1]  # fmt: skip

    @torch.inference_mode()
    def expand(self, tokens: list[int], parents: list[int]) -> torch.Tensor:
        positions, at, mask = self.nodes.add(parents, self._device)
        return self._logprobs(tokens, positions, mask, at)

    def end_tree(self) -> None:
        self.nodes = DraftNodes(0, 0)
