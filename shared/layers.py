"""Llama-style blocks over explicit masks and caches: the drafters' layers, and the LSA the server runs.

Written out instead of borrowed from transformers so that one block serves every use a drafter
has: causal or bidirectional self-attention, cross-attention to a memory, tree-masked draft
nodes, and — sharing the target's own weights — the target's last layers for Target Layer
Inference. Masks are boolean (True = may attend) of shape [B, Tq, Tk]; caches are written by
position (gpt-fast style), so rewinding a draft is just moving a length back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, d]; cos, sin [B, T, d] (as the target's rotary embedding returns them)."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class KVCache:
    """Keys and values of one attention layer, [B, H, capacity, d], written by position."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def write(self, k: torch.Tensor, v: torch.Tensor, at: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v at positions [at, at + n); return everything up to there."""
        end = at + k.shape[2]
        if self.k is None or self.k.shape[2] < end:
            grow = max(end, 2 * (0 if self.k is None else self.k.shape[2]), 64)
            new_k = k.new_zeros(*k.shape[:2], grow, k.shape[3])
            new_v = v.new_zeros(*v.shape[:2], grow, v.shape[3])
            if self.k is not None:
                new_k[:, :, : self.k.shape[2]] = self.k
                new_v[:, :, : self.v.shape[2]] = self.v
            self.k, self.v = new_k, new_v
        self.k[:, :, at:end] = k
        self.v[:, :, at:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]

    def move(self, src: list[int], dst: list[int]) -> None:
        """Copy the entries at ``src`` to ``dst`` (keeping an accepted draft path's KV)."""
        if src != dst and self.k is not None:
            s = torch.tensor(src, device=self.k.device)
            d = torch.tensor(dst, device=self.k.device)
            self.k[:, :, d] = self.k[:, :, s]
            self.v[:, :, d] = self.v[:, :, s]


class Attention(nn.Module):
    """Grouped-query attention; keys and values come from ``source`` (the queries' own input for self-attention)."""

    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int, source_dim: int | None = None,
                 bias: bool = False):  # fmt: skip
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        source_dim = source_dim or dim
        self.q_proj = nn.Linear(dim, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(source_dim, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(source_dim, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, dim, bias=bias)

    def _split(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        return x.view(*x.shape[:2], heads, self.head_dim).transpose(1, 2)

    def keys_values(self, source: torch.Tensor, rope: tuple | None) -> tuple[torch.Tensor, torch.Tensor]:
        k = self._split(self.k_proj(source), self.kv_heads)
        v = self._split(self.v_proj(source), self.kv_heads)
        if rope is not None:
            k = apply_rotary(k, *rope)
        return k, v

    def attend(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               rope: tuple | None) -> torch.Tensor:  # fmt: skip
        """x [B, T, dim] attends to k, v [B, kv_heads, S, d] under mask [B or 1, T, S]."""
        q = self._split(self.q_proj(x), self.heads)
        if rope is not None:
            q = apply_rotary(q, *rope)
        groups = self.heads // self.kv_heads
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask[:, None])
        return self.o_proj(out.transpose(1, 2).flatten(2))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """A pre-norm Llama block (attention + SwiGLU MLP, both residual); the same names as a Llama layer.

    Self-attention: ``forward(x, mask, rope, cache, at)`` computes this input's keys and values,
    writes them into ``cache`` at position ``at`` (if given) and attends to everything there.
    Cross-attention (``source_dim`` set): ``forward(x, mask, rope, memory=(k, v))`` attends to
    keys and values made once per memory entry by ``memory_kv``.
    """

    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int, mlp_hidden: int, eps: float = 1e-5,
                 source_dim: int | None = None, bias: bool = False):  # fmt: skip
        super().__init__()
        self.cross = source_dim is not None
        self.input_layernorm = RMSNorm(dim, eps)
        self.self_attn = Attention(dim, heads, kv_heads, head_dim, source_dim, bias)
        self.post_attention_layernorm = RMSNorm(dim, eps)
        self.mlp = MLP(dim, mlp_hidden, bias)

    def memory_kv(self, memory: torch.Tensor, rope: tuple | None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.self_attn.keys_values(memory, rope)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, rope: tuple | None,
                cache: KVCache | None = None, at: int = 0, memory: tuple | None = None) -> torch.Tensor:  # fmt: skip
        h = self.input_layernorm(x)
        if self.cross:
            k, v = memory
        else:
            k, v = self.self_attn.keys_values(h, rope)
            if cache is not None:
                k, v = cache.write(k, v, at)
        x = x + self.self_attn.attend(h, k, v, mask, rope)
        return x + self.mlp(self.post_attention_layernorm(x))


def causal_mask(n: int, device=None) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()[None]


def node_mask(parents: list[int], new: int, visible: int, slots: list[int], total: int, device=None) -> torch.Tensor:
    """[1, new, total] mask for the last ``new`` draft nodes: every slot < ``visible`` plus each node's path.

    ``parents`` holds the parent of every draft node of the tree so far (an index into the same
    list, or -1 under the committed context); ``slots`` where each node's KV sits in the cache.
    """
    mask = torch.zeros(new, total, dtype=torch.bool)
    mask[:, :visible] = True
    for row, node in enumerate(range(len(parents) - new, len(parents))):
        while node >= 0:
            mask[row, slots[node]] = True
            node = parents[node]
    return mask[None].to(device)
