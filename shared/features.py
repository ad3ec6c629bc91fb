"""What the target tells a drafter about the tokens it has just cached.

A feature-hungry drafter (MoA, EAGLE) sees the target through these tensors only, whether the
target runs in-process (``--local``) or across the network (the server sends them, encoded by
the payload codec). Positions are absolute: ``start`` is the position of the first token covered.

* ``kv``: every layer's key and value of each token, ``[n, L, 2·n_kv·d]`` (keys after RoPE,
  exactly as cached, then values) — MoA's Layer Self-Attention input, and the KV its Target
  Layer Inference attends to.
* ``hidden``: the target's final hidden state (after the final norm) of each token, ``[n, E]``
  — what EAGLE drafts from.

Over the network a MoA drafter may get, instead of ``kv``, what it would have computed from it:
``memory`` (its LSA output, computed by the server, ``[n, E]``) and ``tli_kv`` (the last N
layers' KV, ``[n, N, 2·n_kv·d]``); see ``shared.payload``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KINDS = ("kv", "hidden")


@dataclass
class Features:
    start: int
    kv: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    memory: torch.Tensor | None = None
    tli_kv: torch.Tensor | None = None

    def __repr__(self) -> str:
        shapes = [f"{k}={tuple(v.shape)}" for k, v in vars(self).items() if isinstance(v, torch.Tensor)]
        return f"Features(start={self.start}, {', '.join(shapes) or 'empty'})"

    def __len__(self) -> int:
        for t in (self.kv, self.hidden, self.memory, self.tli_kv):
            if t is not None:
                return t.shape[0]
        return 0

    @staticmethod
    def check_kinds(kinds) -> frozenset[str]:
        unknown = set(kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown feature kinds {sorted(unknown)}; expected some of {list(KINDS)}")
        return frozenset(kinds)


def kv_rows(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The one KV feature layout: keys, values ``[L, *batch, n_kv, n, d]`` -> ``[*batch, n, L, 2·n_kv·d]``."""

    def rows(x: torch.Tensor) -> torch.Tensor:  # [L, *batch, n_kv, n, d] -> [*batch, n, L, n_kv·d]
        return x.movedim(-2, 0).movedim(1, -3).movedim(0, -4).flatten(-2)

    return torch.cat([rows(keys), rows(values)], dim=-1)


def cache_kv(cache, start: int, end: int, slot: int = 0) -> torch.Tensor:
    """``[end-start, L, 2·n_kv·d]``: positions [start, end) of ``slot`` in an engine cache
    (``shared.engine.decoder.Cache``)."""
    return kv_rows(cache.k[:, slot, :, start:end], cache.v[:, slot, :, start:end])


def split_kv(kv: torch.Tensor, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n, L, 2·n_kv·d]`` -> keys, values as ``[L, n_kv, n, d]`` (the inverse of :func:`cache_kv`)."""
    n, layers, width = kv.shape
    d = width // (2 * num_kv_heads)
    k, v = kv.view(n, layers, 2, num_kv_heads, d).permute(2, 1, 3, 0, 4).unbind(0)
    return k, v
