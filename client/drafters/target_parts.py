"""The frozen pieces of the target that a trained drafter reuses, taken from the loaded target.

Drafters borrow the target's token embeddings and LM head (and, for Target Layer Inference, its
last N decoder layers and final norm) instead of learning their own: they stay small, they
speak the target's vocabulary exactly, and a bundle never stores these weights — they are
re-extracted from whatever target is loaded, which must match the bundle's fingerprint.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shared.engine.linear import Linear


@dataclass
class BlockShape:
    """Blocks shaped like the target's (EAGLE's one, the independent drafter's few): the same widths and heads, so
    the target's features and embeddings go in as they are."""

    hidden_size: int  # E, the target's
    heads: int
    kv_heads: int
    head_dim: int
    mlp_hidden: int
    eps: float

    @classmethod
    def for_target(cls, parts: TargetParts, mlp_hidden: int | None = None, **more):
        """``mlp_hidden``: the blocks' MLP width (default the target's; a 1.5B's 8,960 makes a bundle of hundreds of
        MB, so a drafter for it takes a narrower one)."""
        return cls(hidden_size=parts.hidden_size, heads=parts.num_heads, kv_heads=parts.num_kv_heads,
                   head_dim=parts.head_dim, mlp_hidden=mlp_hidden or parts.mlp_hidden, eps=parts.eps,
                   **more)  # fmt: skip

    def to_dict(self) -> dict:
        return asdict(self)


class TargetParts(nn.Module):
    """Embeddings, rotary positions, the last ``tli`` layers, final norm and LM head — frozen, shared.

    With ``vocab_ids`` the LM head is cut to a draft vocabulary (the tokens a drafter may
    propose): the head is most of a small drafter's cost, and a few thousand frequent tokens
    cover nearly all of what the target says. Logits then index ``vocab_ids``.
    """

    def __init__(self, target, tli: int = 0, vocab_ids: torch.Tensor | None = None):
        super().__init__()
        engine, cfg = target.engine, target.engine.cfg
        if not 0 <= tli <= cfg.num_layers:
            raise ValueError(f"tli must be within [0, {cfg.num_layers}] for this target, got {tli}")
        self.tli = tli
        self.hidden_size = cfg.hidden_size
        self.num_layers = cfg.num_layers
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.mlp_hidden = cfg.mlp_hidden
        self.eps = cfg.eps
        self.embed = engine.embed_tokens
        self.norm = engine.norm
        self.rotary = engine.rotary
        # the target's own blocks (not copies): TLI runs them with the same code and cache layout
        self.layers = nn.ModuleList(engine.layers[cfg.num_layers - tli :])
        self.vocab_ids: torch.Tensor | None = None
        self.head: Linear | None = None  # set by quantize_head
        head = engine.lm_head
        self.head_weight = head.weight
        drafting = vocab_ids is not None and len(vocab_ids) > 0
        if drafting:
            self.vocab_ids = torch.as_tensor(vocab_ids, dtype=torch.long, device=engine.norm.weight.device)
            if int(self.vocab_ids.max()) >= head.out_features or int(self.vocab_ids.min()) < 0:
                raise ValueError(f"draft vocabulary ids must lie in [0, {head.out_features})")
            # a low-bit head (a GGUF served on the kernels keeps no float copy) gives the rows its blocks stand for
            rows = head.float_rows(self.vocab_ids).to(engine.norm.weight.device, engine.norm.weight.dtype)
            self.head_weight = nn.Parameter(rows)
        elif self.head_weight is None:
            raise ValueError("this target's LM head is low-bit only (served from a GGUF on the kernels, no float "
                             "copy): a drafter borrowing all of it needs a draft vocabulary, or the target served "
                             "with native weights")
        for p in self.parameters():
            p.requires_grad_(False)

    def quantize_head(self) -> None:
        """The draft head weight-only 4-bit (Q4_1 blocks; int8 where the width is not a multiple of 32): drafts only,
        the target's own head is untouched. The head is most of a small drafter's bytes a step (a 1.5B's 16k rows:
        25 MB int8); 4-bit halves them and drafted the same (the 135M's EAGLE and MoA-TLI1 on 3 MT-Bench + 3 HumanEval
        prompts, 64 tokens: τ 2.18 / 1.95 against int8's 2.14 / 1.96)."""
        head = Linear(self.hidden_size, self.head_weight.shape[0], bias=False, device="meta")
        head.weight = nn.Parameter(self.head_weight.detach(), requires_grad=False)
        head.quantize("int4" if self.hidden_size % 32 == 0 else "int8")
        self.head = head

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, head_dim] for integer positions [B, T], from the target's own rotary tables."""
        return self.rotary(positions, dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head over a final hidden state: TLI=0 predicts it after the final norm, TLI>0 before it."""
        hidden = self.norm(hidden) if self.tli else hidden
        return self.head(hidden) if self.head is not None else F.linear(hidden, self.head_weight)


class DrafterModel(nn.Module):
    """A trained drafter's model: its own layers, and the target's frozen parts in ``parts``, which a bundle never
    stores (they come back from whatever target is loaded)."""

    kind: str
    payload_forms: tuple[str, ...]  # what it reads from the target: ``shared.payload`` forms

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items() if not k.startswith("parts.")}

    def needs_final_state(self, parts: TargetParts) -> None:
        """For a model that predicts (or reads) the target's final hidden state: Target Layer Inference cannot
        apply."""
        if parts.tli:
            raise ValueError(f"{self.kind} works on the target's final hidden state: it needs tli=0, got {parts.tli}")
