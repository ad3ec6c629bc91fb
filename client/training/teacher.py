"""One frozen target forward per batch, shared by every drafter being trained on it.

On a CPU the target's forward is the expensive part of training, so it runs once per batch and
everything any drafter may learn from is kept: per-layer KV, hidden states, and the teacher's
logits at the positions that predict an assistant token. The teacher may be the target as it is
served (low-bit, on the CPU kernels): no gradient flows into it, and its forward is several times
cheaper than the dequantised fp32 model's; the drafters' frozen parts then come from a float copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shared.features import kv_rows
from shared.tree import causal_mask


@dataclass
class TargetBatch:
    """What the target computed on a right-padded batch [B, T].

    Position t "predicts" token t+1; ``rows``/``cols`` list the predicting positions whose next
    token is an assistant token (the only ones that are trained), and ``teacher_logits`` holds
    the target's logits there, [M, V] in that order.
    """

    input_ids: torch.Tensor  # [B, T] long
    valid: torch.Tensor  # [B, T] bool: real tokens, not padding
    hidden: tuple[torch.Tensor, ...]  # L+1 x [B, T, E]: [0] embeddings, [i] entering layer i, [L] final (normed)
    keys: torch.Tensor  # [L, B, n_kv, T, d], after RoPE (the engine cache's own tensors)
    values: torch.Tensor
    rows: torch.Tensor  # [M]
    cols: torch.Tensor  # [M]
    teacher_logits: torch.Tensor  # [M, V]

    @property
    def kv(self) -> torch.Tensor:
        """[B, T, L, 2·n_kv·d]: every layer's key and value per token (MoA's LSA input)."""
        return kv_rows(self.keys, self.values)

    @property
    def tokens(self) -> int:
        return int(self.rows.numel())


def pad_batch(sequences: list[tuple[list[int], list[int]]], pad_id: int = 0) -> tuple[torch.Tensor, ...]:
    """(ids, loss_mask) pairs -> input_ids [B, T], valid [B, T], loss_mask [B, T] (right padding)."""
    T = max(len(ids) for ids, _ in sequences)
    ids = torch.full((len(sequences), T), pad_id, dtype=torch.long)
    valid = torch.zeros(len(sequences), T, dtype=torch.bool)
    mask = torch.zeros(len(sequences), T, dtype=torch.bool)
    for b, (seq, m) in enumerate(sequences):
        ids[b, : len(seq)] = torch.tensor(seq)
        valid[b, : len(seq)] = True
        mask[b, : len(m)] = torch.tensor(m, dtype=torch.bool)
    return ids, valid, mask


@torch.no_grad()
def run_teacher(target, input_ids: torch.Tensor, valid: torch.Tensor, loss_mask: torch.Tensor,
                vocab_ids: torch.Tensor | None = None) -> TargetBatch:  # fmt: skip
    """The frozen target over a batch; positions t with loss_mask[t+1] (and t+1 real) are trained.

    With ``vocab_ids`` the teacher's logits cover only that draft vocabulary (its softmax is then
    the target's distribution renormalised over it — what a drafter limited to it can learn).
    """
    engine = target.engine
    dev = target.device
    # the trained positions from the host-side masks: their count is known without waiting for the device
    predicts = torch.zeros_like(loss_mask)
    predicts[:, :-1] = loss_mask[:, 1:] & valid[:, 1:]
    rows, cols = (i.to(dev, non_blocking=True) for i in predicts.nonzero(as_tuple=True))
    input_ids, valid = input_ids.to(dev, non_blocking=True), valid.to(dev, non_blocking=True)
    B, T = input_ids.shape
    cache = engine.new_cache(T, batch=B)
    trace: list[torch.Tensor] = []
    # right padding: a causal mask alone keeps every real token's states exact (padding comes after it)
    positions = torch.arange(T, device=dev).expand(B, T)
    final = engine(input_ids, positions, causal_mask(T, dev), cache, 0, trace=trace)
    hidden = (*trace, final)
    if engine.lm_head.qweight is not None:  # a low-bit target (as served): its own head, cut to the draft vocabulary
        teacher = engine.lm_head(final[rows, cols]).float()
        if vocab_ids is not None:
            teacher = teacher[:, vocab_ids.to(teacher.device)]
    else:
        head = engine.lm_head.weight
        if vocab_ids is not None:
            head = head[vocab_ids.to(head.device)]
        teacher = F.linear(final[rows, cols], head).float()
    keys, values = cache.k, cache.v
    if keys.dtype != final.dtype:  # a low-bit engine caches fp16: the drafters learn in the hidden states' dtype
        keys, values = keys.to(final.dtype), values.to(final.dtype)
    return TargetBatch(input_ids, valid, hidden, keys, values, rows, cols, teacher)
