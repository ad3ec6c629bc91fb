"""Llama-style building blocks over explicit masks and preallocated caches: the target engine and every drafter.

One block serves every use: the target's own decoder layers (``shared.engine.decoder``), causal or
bidirectional self-attention in the drafters, cross-attention to a memory, tree-masked draft
nodes, and — being the target's very modules — the last layers a MoA drafter runs for Target
Layer Inference. Masks are boolean (True = may attend) of shape [B, Tq, Tk]; caches are
preallocated and written by position (gpt-fast style), so accepting a draft path is an index
copy and rewinding is moving a length back. Projections are fused (one QKV and one gate/up
matmul): on a CPU each matmul call costs a fixed overhead that a 576-wide model feels.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shared.engine import kernels
from shared.engine.linear import Linear


class RMSNorm(nn.Module):
    exact = False  # sum in fp64: a row's norm then does not depend on how a GPU's reduction splits the rows

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.exact:
            return F.rms_norm(x.double(), self.weight.shape, self.weight.double(), self.eps).to(x.dtype)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused op (computes in fp32)


class Rotary(nn.Module):
    """Rotary position tables (cos, sin per position), computed once the way transformers computes them.

    ``inv_freq`` and ``scale`` come from the model's rope settings (``shared.engine.decoder.rope_frequencies``);
    looking rows up by position gives bit-identical values to computing them per call. The tables
    are plain fp32 attributes, not buffers: casting a model to bf16 must not round them.
    """

    def __init__(self, inv_freq: torch.Tensor, scale: float = 1.0, max_positions: int = 2048):
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float)
        freqs = positions[:, None] * inv_freq.float()[None]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos, self.sin = emb.cos() * scale, emb.sin() * scale

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, head_dim] for integer positions [B, T]."""
        if self.cos.device != positions.device:
            self.cos, self.sin = self.cos.to(positions.device), self.sin.to(positions.device)
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, d]; cos, sin [B, T, d]."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def attention_dtype(dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """What attention computes in: fp32 on a CPU for a bf16 model, else the model's dtype.

    torch's CPU attention kernels are several times slower in bf16 than in fp32 (measured: one
    query over 300 keys, 151 vs 18 us a layer) and the matmuls there are tiny, so a bf16 model
    keeps its KV cache and attention in fp32 on a CPU; that is also more precise. On CUDA bf16
    flash kernels are the fast path.
    """
    if dtype == torch.bfloat16 and torch.device(device).type == "cpu":
        return torch.float32
    return dtype


def grown(t: torch.Tensor, dim: int, end: int, least: int = 0, limit: int | None = None) -> torch.Tensor:
    """``t`` with room for ``end`` entries along ``dim``, its contents kept: the same tensor when it has the room,
    else a new one doubled (at least ``end`` and ``least``, at most ``limit``) — amortised O(1) appends."""
    size = t.shape[dim]
    if end <= size:
        return t
    room = max(end, least, 2 * size)
    room = min(room, limit) if limit is not None else room
    new = t.new_zeros(*t.shape[:dim], room, *t.shape[dim + 1 :])
    new.narrow(dim, 0, size).copy_(t)
    return new


class KVCache:
    """Keys and values of one attention layer, [B, H, capacity, d], written by position.

    With ``capacity`` the storage is allocated once, on the first write (its batch, heads, dtype
    and device come from what is written); without, it grows by doubling (drafters that do not
    know their context length). Only the filled prefix is ever attended to: ``write`` returns
    views up to the end of what it wrote.
    """

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @classmethod
    def over(cls, k: torch.Tensor, v: torch.Tensor) -> KVCache:
        """A cache over given (preallocated) storage [B, H, capacity, d]: ``shared.engine.decoder.Cache``'s layers."""
        cache = cls(k.shape[2])
        cache.k, cache.v = k, v
        return cache

    def _reserve(self, like: torch.Tensor, end: int) -> None:
        if self.k is None:
            self.k, self.v = like[:, :, :0], like[:, :, :0]
        if self.k.shape[2] < end:
            self.k, self.v = (grown(t, 2, end, least=max(self.capacity or 0, 64)) for t in (self.k, self.v))

    def storage(self, end: int, batch: int, heads: int, head_dim: int, like: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The whole key and value storage, with room for positions [0, end) (a kernel writes into it)."""
        self._reserve(like.new_empty(batch, heads, 0, head_dim), end)
        return self.k, self.v

    def write(self, k: torch.Tensor, v: torch.Tensor, at: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, H, n, d] at positions [at, at + n); return everything up to there."""
        end = at + k.shape[2]
        self._reserve(k, end)
        self.k[:, :, at:end] = k
        self.v[:, :, at:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


def _fuse(state: dict, prefix: str, parts: tuple[str, ...], fused: str) -> None:
    """Load-time fusion: separate ``q_proj``/``k_proj``/... weights (a transformers checkpoint, an older
    bundle) become one fused matrix, so every checkpoint loads into the same fused modules."""
    for kind in ("weight", "bias"):
        names = [f"{prefix}{p}.{kind}" for p in parts]
        if all(n in state for n in names):
            state[f"{prefix}{fused}.{kind}"] = torch.cat([state.pop(n) for n in names])


class Attention(nn.Module):
    """Grouped-query attention with fused projections.

    Self-attention: one ``qkv`` matmul. Cross-attention (``source_dim`` set): ``q_proj`` on the
    queries' input, one ``kv_proj`` on the memory, made once per memory entry (``keys_values``).
    """

    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int, source_dim: int | None = None,
                 bias: bool = False, out_bias: bool = False):  # fmt: skip
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.cross = source_dim is not None
        if self.cross:
            self.q_proj = Linear(dim, heads * head_dim, bias=bias)
            self.kv_proj = Linear(source_dim, 2 * kv_heads * head_dim, bias=bias)
        else:
            self.qkv = Linear(dim, (heads + 2 * kv_heads) * head_dim, bias=bias)
        self.o_proj = Linear(heads * head_dim, dim, bias=out_bias)
        self._register_load_state_dict_pre_hook(self._fuse_checkpoint)

    def _fuse_checkpoint(self, state, prefix, *args) -> None:
        if self.cross:
            _fuse(state, prefix, ("k_proj", "v_proj"), "kv_proj")
        else:
            _fuse(state, prefix, ("q_proj", "k_proj", "v_proj"), "qkv")

    def _split(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        return x.view(*x.shape[:2], heads, self.head_dim).transpose(1, 2)

    def project(self, x: torch.Tensor, rope: tuple | None) -> tuple[torch.Tensor, ...]:
        """Self-attention's q [B, H, T, d], k, v [B, kv_heads, T, d] for input x [B, T, dim], rotated."""
        return self.heads_of(*self.rotated(x, rope))

    def rotated(self, x: torch.Tensor, rope: tuple | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``project`` before the heads are split off: queries and keys [B, T, H + kv_heads, d], rotated, and values
        [B, T, kv_heads, d] (what ``shared.engine.graphs`` keeps between its captured steps)."""
        H, kv = self.heads, self.kv_heads
        qkv = self.qkv(x).view(*x.shape[:2], H + 2 * kv, self.head_dim)
        qk, v = qkv[:, :, : H + kv], qkv[:, :, H + kv :]
        if rope is not None:  # queries and keys rotated together: half the ops
            cos, sin = rope[0][:, :, None], rope[1][:, :, None]
            qk = qk * cos + rotate_half(qk) * sin
        return qk, v

    def heads_of(self, qk: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, H, T, d], k, v [B, kv_heads, T, d] as views of ``rotated``'s outputs."""
        H = self.heads
        return qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2), v.transpose(1, 2)

    def query(self, x: torch.Tensor, rope: tuple | None) -> torch.Tensor:
        q = self._split(self.q_proj(x), self.heads)
        return q if rope is None else apply_rotary(q, *rope)

    def keys_values(self, source: torch.Tensor, rope: tuple | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-attention keys and values of a memory [B, M, source_dim]."""
        k, v = self.kv_proj(source).chunk(2, dim=-1)
        k, v = self._split(k, self.kv_heads), self._split(v, self.kv_heads)
        return (k if rope is None else apply_rotary(k, *rope)), v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """q [B, H, T, d] attends to k, v [B, kv_heads, S, d] under mask [B or 1, T, S] (None: everything)."""
        return self.o_proj(self.attention(q, k, v, mask))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """``attend`` before the output projection: [B, T, H·d] in q's dtype."""
        # in the cache's precision if that is higher (the target's exact mode keeps it in fp64)
        work, dtype = torch.promote_types(attention_dtype(q.dtype, q.device), k.dtype), q.dtype
        q, k, v = q.to(work), k.to(work), v.to(work)
        mask = None if mask is None else mask[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.heads != self.kv_heads)
        return out.transpose(1, 2).flatten(2).to(dtype)


def attend_spans(attn: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: list[Span]) -> torch.Tensor:
    """Each span's rows of q [B, H, R, d], k, v [B, kv, R, d] written into its cache (if any) and attended over it,
    one span after another: [B, rows, H·d]."""
    outs = []
    for s in spans:
        kk, vv = k[:, :, s.start : s.end], v[:, :, s.start : s.end]
        if s.cache is not None:
            kk, vv = s.cache.write(kk, vv, s.at)
        outs.append(attn.attention(q[:, :, s.start : s.end], kk, vv, s.mask))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


class MLP(nn.Module):
    """SwiGLU with one fused gate/up matmul."""

    def __init__(self, dim: int, hidden: int, bias: bool = False):
        super().__init__()
        self.gate_up = Linear(dim, 2 * hidden, bias=bias)
        self.down_proj = Linear(hidden, dim, bias=bias)
        self._register_load_state_dict_pre_hook(lambda state, prefix, *a: _fuse(state, prefix,
                                                                               ("gate_proj", "up_proj"), "gate_up"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    """A pre-norm Llama block (attention + SwiGLU MLP, both residual); the same names as a Llama layer.

    Self-attention: ``forward(x, mask, rope, cache, at)`` computes this input's keys and values,
    writes them into ``cache`` at position ``at`` (if given) and attends to everything there that
    ``mask`` allows. Cross-attention (``source_dim`` set): ``forward(x, mask, rope, memory=(k, v))``
    attends to keys and values made once per memory entry by ``memory_kv``.
    """

    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int, mlp_hidden: int, eps: float = 1e-5,
                 source_dim: int | None = None, bias: bool = False, out_bias: bool = False,
                 mlp_bias: bool = False):  # fmt: skip
        super().__init__()
        self.cross = source_dim is not None
        self.input_layernorm = RMSNorm(dim, eps)
        self.self_attn = Attention(dim, heads, kv_heads, head_dim, source_dim, bias, out_bias)
        self.post_attention_layernorm = RMSNorm(dim, eps)
        self.mlp = MLP(dim, mlp_hidden, mlp_bias)
        self._shape = (heads, kv_heads, head_dim)
        self._kernel = None  # kernel_blocks([self]), made on first use

    def memory_kv(self, memory: torch.Tensor, rope: tuple | None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.self_attn.keys_values(memory, rope)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, rope: tuple | None,
                cache: KVCache | None = None, at: int = 0, memory: tuple | None = None) -> torch.Tensor:  # fmt: skip
        if not self.cross:
            return self.forward_spans(x, rope, [Span(0, x.shape[1], cache, at, mask)])
        h = self.input_layernorm(x)
        x = x + self.self_attn.attend(self.self_attn.query(h, rope), *memory, mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_spans(self, x: torch.Tensor, rope: tuple | None, spans: list[Span]) -> torch.Tensor:
        """Self-attention block over input x [B, T, E] whose rows are split into ``spans``: each span's keys and
        values go into its own cache and it attends only to that cache (several sequences in one forward: the
        projections and the MLP see all their rows as one matrix, the weights read once for all)."""
        if self._fused(x, rope, spans):
            return self._forward_lowbit(x, rope, spans)
        if self._kernel_attention(x, rope, spans):  # bf16 on a CPU: the fixed-order fp32 attention, exact per query
            qkv = self.self_attn.qkv(self.input_layernorm(x))[0].float()
            outs = [self._attend(qkv, rope, s)[None].to(x.dtype) for s in spans]
            return self.after_attention(x, outs[0] if len(outs) == 1 else torch.cat(outs, dim=1))
        return self.forward_attending(x, rope, functools.partial(attend_spans, spans=spans))

    def forward_attending(self, x: torch.Tensor, rope: tuple | None, attend) -> torch.Tensor:
        """The block with its attention given: ``attend(attn, q, k, v)`` [B, T, H·d] (a forward's sequences at once:
        ``shared.engine.padded``)."""
        return self.after_attention(x, attend(self.self_attn, *self.self_attn.project(self.input_layernorm(x), rope)))

    def after_attention(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The block's rest once attention has run ([B, T, H·d]): output projection and residual, norm, MLP and
        residual."""
        x = x + self.self_attn.o_proj(attended)
        return x + self.mlp(self.post_attention_layernorm(x))

    def _kernel_attention(self, x: torch.Tensor, rope: tuple | None, spans: list[Span]) -> bool:
        """Whether attention runs in the CPU kernel for a model that is not fp32: a bf16 model's rows must not
        depend on the query count (``shared.engine.decoder.load_engine``), and torch's bf16 CPU attention is slow
        anyway. fp32 keeps torch's attention: it is what equals transformers; so does an fp64 cache (a GPU's exact
        recipe, ``shared.engine.decoder.exact_rows``)."""
        fp32 = all(s.cache is not None and (s.cache.k is None or s.cache.k.dtype == torch.float32) for s in spans)
        return (x.device.type == "cpu" and x.dtype != torch.float32 and x.shape[0] == 1 and rope is not None
                and not x.requires_grad and fp32 and kernels.available())  # fmt: skip

    def _attend(self, qkv: torch.Tensor, rope: tuple, s: Span) -> torch.Tensor:
        """Span ``s``'s rows of the fused projections qkv [T, W] (fp32) through the attention kernel: [t, H·d]."""
        heads, kv_heads, head_dim = self._shape
        a, b = s.start, s.end
        k, v = s.cache.storage(s.at + b - a, 1, kv_heads, head_dim, qkv)
        cos, sin = rope[0][0, a:b], rope[1][0, a:b]
        if cos.dtype != torch.float32:
            cos, sin = cos.float(), sin.float()
        return kernels.ops().attend(qkv[a:b], cos, sin, k[0], v[0], s.at, s.mask, heads, kv_heads,
                                    head_dim**-0.5)  # fmt: skip

    def kernel_blocks(self):
        """This block on the CPU kernels (``kernel_blocks``), made once; None while any projection is not low-bit."""
        if self._kernel is None and not self.cross:
            self._kernel = kernel_blocks([self])
        return self._kernel

    def _apply(self, fn, recurse=True):
        self._kernel = None  # the tensors it holds are about to be replaced
        return super()._apply(fn, recurse)

    def _fused(self, x: torch.Tensor, rope: tuple | None, spans: list[Span]) -> bool:
        """Whether the low-bit kernels run this block in one call: fp32 on a CPU, one batch row, every span cached,
        nothing to differentiate (the kernels have no backward)."""
        return (x.dtype == torch.float32 and x.device.type == "cpu" and x.shape[0] == 1 and rope is not None
                and not x.requires_grad and self.kernel_blocks() is not None
                and all(s.cache is not None for s in spans))  # fmt: skip

    def _forward_lowbit(self, x: torch.Tensor, rope: tuple, spans: list[Span]) -> torch.Tensor:
        """``forward_spans`` in the CPU kernels (``shared.engine.kernels``), int8 or int4 weights alike: the same
        block, no per-op Python overhead."""
        _, kv_heads, head_dim = self._shape
        caches = [s.cache.storage(s.at + s.end - s.start, 1, kv_heads, head_dim, x) for s in spans]
        return run_blocks(self._kernel, x[0], rope, [(k[None], v[None]) for k, v in caches], spans)[None]


_NO_MASK = torch.empty(0, dtype=torch.bool)  # what the kernels take for "no mask" and "no bias"
_NO_BIAS = torch.empty(0)


def kernel_blocks(blocks: list[Block]):
    """``blocks`` (consecutive, the same shape) as one ``shared.engine.kernels.Blocks``: a forward through all of
    them crosses into C++ once. None unless every projection of every block is low-bit and the kernels are here."""
    tensors, eps = [], []
    for b in blocks:
        attn, mlp = b.self_attn, b.mlp
        layers = (attn.qkv, attn.o_proj, mlp.gate_up, mlp.down_proj)
        if b.cross or any(m.qweight is None for m in layers) or not kernels.available():
            return None
        ln1, ln2 = b.input_layernorm, b.post_attention_layernorm
        qkv, o, gate_up, down = (_kernel_tensors(m) for m in layers)
        tensors += [ln1.weight.detach(), *qkv, *o, ln2.weight.detach(), *gate_up, *down]
        eps += [ln1.eps, ln2.eps]
    heads, kv_heads, head_dim = blocks[0]._shape
    build = blocks[0].mlp.down_proj.kernel_build
    return kernels.Blocks(tensors, eps, heads, kv_heads, head_dim**-0.5, tag=build)


def _kernel_tensors(layer) -> list[torch.Tensor]:
    """A low-bit projection as ``shared.engine.kernels.Blocks`` takes it: weight, scales and bias of its own rows,
    then of its ``tail`` (empty tensors: no bias, no tail)."""
    parts = [layer] if layer.tail is None else [layer, layer.tail]
    tensors = []
    for part, bias in zip(parts, layer.int8_biases(), strict=True):
        tensors += [part.qweight, part.qscale, _NO_BIAS if bias is None else bias]
    return tensors + [_NO_BIAS] * (6 - len(tensors))


def run_blocks(stack, x: torch.Tensor, rope: tuple, caches: list[tuple[torch.Tensor, torch.Tensor]],
               spans: list[Span]) -> torch.Tensor:  # fmt: skip
    """x [T, E] through a ``kernel_blocks`` stack; span i's keys and values go to caches[i] (keys, values
    [blocks, 1, KV, capacity, d], room made)."""
    cos, sin = rope[0][0], rope[1][0]
    if cos.dtype != torch.float32:
        cos, sin = cos.float(), sin.float()
    masks = [_NO_MASK if s.mask is None else s.mask for s in spans]
    return stack.forward(x, cos, sin, [k for k, _ in caches], [v for _, v in caches], [s.end for s in spans],
                         [s.at for s in spans], masks)  # fmt: skip


@dataclass
class Span:
    """Rows [start, end) of a block's input: one sequence's tokens, written into ``cache`` (if any) from slot ``at``,
    each attending to the cache slots [0, at + end - start) that ``mask`` [1, end - start, at + end - start] allows
    (None: all of them)."""

    start: int
    end: int
    cache: KVCache | None
    at: int = 0
    mask: torch.Tensor | None = None
