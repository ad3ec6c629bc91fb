"""An independent small drafter LM: the classic speculative-decoding baseline.

It shares the target's tokenizer, embeddings and LM head (frozen, never saved) but needs nothing
from the target at run time: no features cross the link, any verifier will do, and it keeps
drafting when the server is gone. The price: it sees tokens only, never the target's states, so
its few layers must learn the target's distribution on their own.

Also here, shared with the EAGLE drafter: ``TreeDrafter`` (a drafter that scores its own EAGLE-2
trees), ``DraftNodes`` (a tree's node positions, cache slots and masks) and ``causal_from``.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from client.drafters.base import Drafter
from client.drafters.layers import Block, KVCache, RMSNorm, causal_mask, node_mask
from client.drafters.target_parts import TargetParts
from client.drafters.tree_search import eagle2_tree
from client.training.teacher import TargetBatch, distill_kl
from shared.features import Features
from shared.tree import DraftTree


@dataclass
class IndependentConfig:
    layers: int
    hidden_size: int  # E, the target's: the drafter reads the target's embeddings and feeds its LM head
    heads: int
    kv_heads: int
    head_dim: int
    mlp_hidden: int
    eps: float

    @classmethod
    def for_target(cls, parts: TargetParts, layers: int = 2) -> IndependentConfig:
        return cls(layers, parts.hidden_size, parts.num_heads, parts.num_kv_heads, parts.head_dim, parts.mlp_hidden,
                   parts.eps)  # fmt: skip

    def to_dict(self) -> dict:
        return asdict(self)


class Independent(nn.Module):
    """A few trainable Llama blocks and a final norm between the target's frozen embeddings and LM head."""

    kind = "independent"
    features = frozenset()

    def __init__(self, cfg: IndependentConfig, parts: TargetParts):
        super().__init__()
        if parts.tli:
            raise ValueError(f"the independent drafter predicts the final hidden state: needs tli=0, got {parts.tli}")
        self.cfg = cfg
        self.layers = nn.ModuleList(
            Block(cfg.hidden_size, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.mlp_hidden, cfg.eps)
            for _ in range(cfg.layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.eps)
        self.parts = parts

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items() if not k.startswith("parts.")}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                caches: list[KVCache] | None = None, at: int = 0) -> torch.Tensor:  # fmt: skip
        """Final (normed) hidden states [B, n, E] of tokens at integer ``positions`` [B, n].

        With ``caches`` (one per layer) their keys and values are written at slot ``at`` and the
        tokens attend to every cached slot that ``mask`` [1, n, at + n] allows.
        """
        dtype = self.norm.weight.dtype
        rope = self.parts.rope(positions, dtype)
        x = self.parts.embed(input_ids).to(dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, mask, rope, None if caches is None else caches[i], at)
        return self.norm(x)

    def loss(self, tb: TargetBatch, generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """KL(target ‖ drafter) at the trained positions; nothing is random, so ``generator`` is unused."""
        B, T = tb.input_ids.shape
        positions = torch.arange(T, device=tb.input_ids.device).expand(B, T)
        hidden = self(tb.input_ids, positions, causal_mask(T, tb.input_ids.device))
        logits = self.parts.logits(hidden[tb.rows, tb.cols])
        kl = distill_kl(tb.teacher_logits, logits)
        return kl, {"kl": kl.item(), "acc": agreement(tb.teacher_logits, logits)}


def agreement(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> float:
    """How often the drafter's top-1 token is the target's: what greedy acceptance rewards."""
    return (student_logits.argmax(-1) == teacher_logits.argmax(-1)).float().mean().item()


# --- incremental tree drafting: shared with the EAGLE drafter ---


class TreeDrafter(Drafter):
    """A drafter that is its own ``TreeScorer``: ``propose`` searches an EAGLE-2 tree of ``width`` x ``depth``."""

    def __init__(self, model: nn.Module, width: int = 4, depth: int = 5, name: str | None = None):
        self.model = model.eval()
        self.width, self.depth = width, depth
        self.name = name or model.kind
        self.features = model.features

    @property
    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def _dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @abstractmethod
    def can_draft(self) -> bool:
        """Whether there is enough context to draft from (otherwise ``propose`` returns an empty tree)."""

    def propose(self, max_nodes: int) -> DraftTree:
        if max_nodes < 1 or not self.can_draft():
            return DraftTree()
        tree, _ = eagle2_tree(self, self.width, self.depth, max_nodes, vocab_ids=self.model.parts.vocab_ids)
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


def causal_from(start: int, n: int, device=None) -> torch.Tensor:
    """[1, n, start + n]: n new tokens at slots start.. see every slot before them and themselves causally."""
    mask = torch.ones(n, start + n, dtype=torch.bool, device=device)
    mask[:, start:] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    return mask[None]


class IndependentDrafter(TreeDrafter):
    """Incremental drafting with one KV cache per layer: committed tokens are fed once, trees after the root.

    Cache slots are positions. Committed tokens are fed lazily when a tree starts; a tree's draft
    nodes take the slots after the root and are simply overwritten by the next tree, so tokens
    accepted from a tree are fed again as committed ones.
    """

    def begin(self, tokens: list[int], payload: Features | None = None) -> None:
        self.tokens: list[int] = []
        self.fed = 0  # committed tokens already in the caches
        self.caches = [KVCache() for _ in self.model.layers]
        self.nodes = DraftNodes(0, 0)
        self.absorb(tokens, payload)

    def absorb(self, tokens: list[int], payload: Features | None = None) -> None:
        self.tokens += tokens  # the target's features are of no use here

    def rewind(self, n: int) -> None:
        if n > 0:
            self.tokens = self.tokens[:-n]
            self.fed = min(self.fed, len(self.tokens))

    # --- TreeScorer ---

    def _logprobs(self, tokens: list[int], positions: list[int], mask: torch.Tensor, at: int) -> torch.Tensor:
        ids = torch.tensor([tokens], device=self._device)
        hidden = self.model(ids, torch.tensor([positions], device=self._device), mask, self.caches, at)
        return torch.log_softmax(self.model.parts.logits(hidden[0]).float(), dim=-1)

    @torch.inference_mode()
    def root_logprobs(self) -> torch.Tensor:
        root = len(self.tokens) - 1
        start = min(self.fed, root)  # the root is always fed (again): its output is what drafts
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

    def can_draft(self) -> bool:
        return bool(self.tokens)
