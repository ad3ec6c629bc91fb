"""An independent small drafter LM: the classic speculative-decoding baseline.

It shares the target's tokenizer, embeddings and LM head (frozen, never saved) but needs nothing
from the target at run time: no features cross the link, any verifier will do, and it keeps
drafting when the server is gone. The price: it sees tokens only, never the target's states, so
its few layers must learn the target's distribution on their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from client.drafters.target_parts import BlockShape, DrafterModel, TargetParts
from client.drafters.tree_drafter import TokenCache, TreeDrafter
from shared.engine.layers import Block, KVCache, RMSNorm
from shared.features import Features


@dataclass
class IndependentConfig(BlockShape):
    """``layers`` blocks the target's shape, reading the target's embeddings and feeding its LM head."""

    layers: int = 2

    @classmethod
    def for_target(cls, parts: TargetParts, mlp_hidden: int | None = None, layers: int = 2) -> IndependentConfig:
        return super().for_target(parts, mlp_hidden, layers=layers)


class Independent(DrafterModel):
    """A few trainable Llama blocks and a final norm between the target's frozen embeddings and LM head."""

    kind = "independent"
    payload_forms = ()  # nothing: it reads only tokens

    def __init__(self, cfg: IndependentConfig, parts: TargetParts):
        super().__init__()
        self.needs_final_state(parts)
        self.cfg = cfg
        self.layers = nn.ModuleList(
            Block(cfg.hidden_size, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.mlp_hidden, cfg.eps)
            for _ in range(cfg.layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.eps)
        self.parts = parts

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


class IndependentDrafter(TokenCache, TreeDrafter):
    """Incremental drafting with one KV cache per layer, slots by position (``TokenCache``)."""

    def begin(self, tokens: list[int], features: Features | None = None) -> None:
        self.clear_tokens()
        self.caches = [KVCache() for _ in self.model.layers]
        self.absorb(tokens, features)

    def _logprobs(self, tokens: list[int], positions: list[int], mask: torch.Tensor, at: int) -> torch.Tensor:
        ids = torch.tensor([tokens], device=self._device)
        hidden = self.model(ids, torch.tensor([positions], device=self._device), mask, self.caches, at)
        return torch.log_softmax(self.model.parts.logits(hidden[0]).float(), dim=-1)

    def can_draft(self) -> bool:
        return bool(self.tokens)
