"""Llama-style building blocks over explicit masks and static caches: the target engine and every drafter.

One block serves every use: the target's own decoder layers (``shared.engine``), causal or
bidirectional self-attention in the drafters, cross-attention to a memory, tree-masked draft
nodes, and — being the target's very modules — the last layers a MoA drafter runs for Target
Layer Inference. Masks are boolean (True = may attend) of shape [B, Tq, Tk]; caches are
preallocated and written by position (gpt-fast style), so accepting a draft path is an index
copy and rewinding is moving a length back. Projections are fused (one QKV and one gate/up
matmul): on a CPU each matmul call costs a fixed overhead that a 576-wide model feels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shared.kernels import ops as kernels_ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused op (computes in fp32)


class Rotary(nn.Module):
    """Rotary position tables (cos, sin per position), computed once the way transformers computes them.

    ``inv_freq`` and ``scale`` come from the model's rope settings (``shared.engine.rope_frequencies``);
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
        """A cache over given (preallocated) storage [B, H, capacity, d]: ``shared.engine.Cache``'s layers."""
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


def pack_int8(weight: torch.Tensor, layout: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [out, in] as the CPU kernels take it: int8 with one fp32 scale per row (max |w| / 127), columns
    padded to 32 with zeros, laid out in the order a kernel build streams it (``layout``; default: the active
    build's). ``rows4`` (AVX2, portable): tiles of 4 rows whose 32-value steps lie together, as a matrix
    [out padded to 4, in]; ``cols16`` (AVX-512 VNNI): tiles of 16 rows, each 4 values of a row together and the
    16 rows side by side, [out / 16, in / 4, 16, 4] (a 32-bit lane is one output)."""
    from shared import kernels

    layout = layout or kernels.ops().int8_layout()
    if layout not in ("rows4", "cols16"):
        raise ValueError(f"unknown int8 layout {layout!r}; expected rows4 or cols16")
    w = weight.detach().float().cpu()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127
    tile = 4 if layout == "rows4" else 16
    rows, cols = -(-w.shape[0] // tile) * tile, -(-w.shape[1] // 32) * 32
    q = torch.zeros(rows, cols, dtype=torch.int8)
    q[: w.shape[0], : w.shape[1]] = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    if layout == "rows4":
        q = q.view(rows // 4, 4, cols // 32, 32).transpose(1, 2).contiguous().view(rows, cols)
    else:
        q = q.view(rows // 16, 16, cols // 4, 4).transpose(1, 2).contiguous()
    return q, scale.contiguous()


# the column order of a 4-bit tile's scales: the order the kernel's widened int16 sums come in (shared.kernels' gemm_q4)
_Q4_SLOTS = (0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15)


def pack_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [out, in] (out a multiple of 16, in of 32) as 4-bit Q4_1 blocks for the CPU kernels: per row and
    32-value block, w ≈ d·q + m with q in 0..15, d = (max - min) / 15 and m = min in fp16. A checkpoint
    dequantised from Q4_1 (the built-in target's GGUF) comes back to exactly its own quants. Returns the quants
    [out / 16, in / 32, 256] and the scales [out / 16, in / 32, 2, 16] (d, m), tiles of 16 rows laid out as
    ``cpu.cpp``'s gemm_q4 streams them: a 32-byte group g holds each row's values 2g, 2g + 1 (low nibbles) and
    2g + 16, 2g + 17 (high nibbles), row after row."""
    w = weight.detach().float().cpu()
    n, k = w.shape
    if n % 16 or k % 32:
        raise ValueError(f"4-bit weights need rows in multiples of 16 and columns of 32, got {n}x{k}")
    blocks = w.view(n, k // 32, 32)
    low, high = blocks.amin(-1), blocks.amax(-1)
    d, m = ((high - low) / 15).half(), low.half()
    q = ((blocks - m.float()[..., None]) / d.float().clamp_min(1e-30)[..., None]).round().clamp(0, 15).to(torch.uint8)
    return pack_int4_blocks(q.view(n, k), d, m)


def pack_int4_blocks(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """4-bit values q [out, in] (0..15) with each 32-value block's step d and minimum m [out, in / 32] (value =
    d·q + m; d and m are stored in fp16) in ``pack_int4``'s layout: how a GGUF's own 4-bit blocks are served."""
    n, k = q.shape
    if n % 16 or k % 32 or d.shape != (n, k // 32) or m.shape != d.shape:
        raise ValueError(f"4-bit blocks: values {tuple(q.shape)} (rows in multiples of 16, columns of 32) with "
                         f"scales and minimums [{n}, {k // 32}]; got {tuple(d.shape)}, {tuple(m.shape)}")  # fmt: skip
    d, m = d.half(), m.half()
    pairs = q.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).reshape(n // 16, k // 32, 16, 32)
    quants = (pairs[:, :, :8] | (pairs[:, :, 8:] << 4)).reshape(n // 16, k // 32, 256).contiguous()
    dm = torch.stack([d, m], dim=-1).view(n // 16, 16, k // 32, 2).permute(0, 2, 3, 1)
    return quants, dm[..., list(_Q4_SLOTS)].contiguous()


def dequantize_int4(quants: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [out, in] that ``pack_int4``'s quants and block scales stand for (d·q + m, in fp32)."""
    tiles, blocks = quants.shape[:2]
    groups = quants.view(tiles, blocks, 8, 32)
    pairs = torch.cat([groups & 15, groups >> 4], dim=2).view(tiles, blocks, 16, 16, 2)
    values = pairs.permute(0, 3, 1, 2, 4).reshape(tiles * 16, blocks, 32).float()
    order = torch.tensor(_Q4_SLOTS).argsort()
    d, m = scales[..., order].permute(0, 3, 1, 2).reshape(tiles * 16, blocks, 2).float().unbind(-1)
    return (values * d[..., None] + m[..., None]).reshape(tiles * 16, blocks * 32)


class Linear(nn.Linear):
    """``nn.Linear`` whose rows do not depend on how many rows are multiplied together, optionally int8.

    oneDNN's bf16 GEMM gives bit-identical rows for any M >= 2 but takes another path for a single
    row with K = 1536 (SmolLM2's down projection), whose sums round differently: plain decoding
    (one token) then drifted from tree verification (many) and greedy outputs parted at near-ties.
    A single bf16 row is multiplied as two (the second a zero row): no slower, since the weights are
    streamed once either way. fp32 rows are left alone: MKL's single-row path is a fast GEMV, and
    its multi-row rounding differs anyway (fp32 exactness is against transformers, within ties).

    ``quantize`` makes it low-bit on a CPU (``shared.kernels``): ``int8`` weights with one scale per output
    row (each input row quantised to int8 with its own scale: one exact integer sum a dot product), or
    ``int4`` (Q4_1 blocks of 32, fp16 scale and minimum each: ``pack_int4``; input rows quantised with a
    scale per 32-value block, every block's sum exact). A quarter (an eighth) of fp32's bytes to stream,
    and a row's result is the same whatever rows share the call.
    """

    qweight: torch.Tensor | None = None  # int8 in its kernel build's layout (pack_int8), or int4 quants (pack_int4)
    kernel_build: str | None = None  # the kernel build that packed it (``shared.kernels``)
    qscale: torch.Tensor | None = None  # fp32 [out], or int4 block scales

    def quantize(self, kind: str = "int8", keep_weight: bool = False) -> None:
        """Make this layer ``int8``, ``int4`` (where the shape allows, else int8) or ``lowbit`` (int4 where the weight
        already lies on a Q4_1 grid, so nothing changes, else int8); CPU only. ``keep_weight`` keeps the float
        weight too (a tied embedding uses it)."""
        from shared import kernels

        if self.weight.device.type != "cpu":
            raise ValueError(f"low-bit weights are a CPU path; this layer is on {self.weight.device}")
        if not kernels.available():
            raise ValueError(f"low-bit weights need splitspec's CPU kernels: {kernels.unavailable_reason()}")
        fits = self.out_features % 16 == 0 and self.in_features % 32 == 0
        packed = pack_int4(self.weight) if kind in ("int4", "lowbit") and fits else None
        if kind == "lowbit" and packed is not None and not torch.equal(dequantize_int4(*packed), self.weight.float()):
            packed = None  # not on a Q4_1 grid: int4 would change the weights, int8 changes them least
        self.qweight, self.qscale = packed or pack_int8(self.weight)
        self.kernel_build = kernels.active()  # the build whose layout it is packed in, and that runs it
        if not keep_weight:
            self.weight = None  # the int8 copy is the weight now

    def weights_kind(self) -> str:
        """``native``, ``int8`` or ``int4``: what this layer computes with."""
        if self.qweight is None:
            return "native"
        return "int4" if self.qweight.dtype == torch.uint8 else "int8"

    def _apply(self, fn, recurse=True):
        module = super()._apply(fn, recurse)
        if self.qweight is not None:  # follow device moves; the int8 matrix and its fp32 scales keep their dtypes
            device = fn(torch.empty(0)).device
            self.qweight, self.qscale = self.qweight.to(device), self.qscale.to(device)
        return module

    def int8_bias(self) -> torch.Tensor | None:
        return None if self.bias is None else self.bias.float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            if x.device.type != "cpu":
                raise RuntimeError(f"a low-bit layer computes on the CPU; its input is on {x.device}")
            if x.shape[-1] != self.in_features:  # the kernel sees only the padded width
                raise ValueError(f"input of width {x.shape[-1]} for a layer of {self.in_features} inputs")
            out = kernels_ops(self.kernel_build).linear(x.float(), self.qweight, self.qscale, self.int8_bias(), None)
            return out.to(x.dtype)
        single = x.numel() == x.shape[-1] and x.device.type == "cpu" and x.dtype == torch.bfloat16
        rows = x.reshape(-1, x.shape[-1])
        if single:
            rows = torch.cat([rows, rows.new_zeros(rows.shape)])
        out = F.linear(rows, self.weight, self.bias)
        return out[: rows.shape[0] - single].view(*x.shape[:-1], -1)


def quantize(module: nn.Module, kind: str = "int8", skip: tuple[nn.Module, ...] = ()) -> int:
    """Make every :class:`Linear` under ``module`` (but those in ``skip``) ``int8`` or ``int4``; how many."""
    count = 0
    for m in module.modules():
        if isinstance(m, Linear) and m.qweight is None and not any(m is s for s in skip):
            m.quantize(kind)
            count += 1
    return count


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
        H, kv = self.heads, self.kv_heads
        qkv = self.qkv(x).view(*x.shape[:2], H + 2 * kv, self.head_dim)
        qk, v = qkv[:, :, : H + kv], qkv[:, :, H + kv :]
        if rope is not None:  # queries and keys rotated together: half the ops
            cos, sin = rope[0][:, :, None], rope[1][:, :, None]
            qk = qk * cos + rotate_half(qk) * sin
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
            return self._forward_int8(x, rope, spans)
        attn = self.self_attn
        h = self.input_layernorm(x)
        outs = []
        if self._kernel_attention(x, rope, spans):  # bf16 on a CPU: the fixed-order fp32 attention, exact per query
            qkv = attn.qkv(h)[0].float()
            for s in spans:
                outs.append(self._attend(qkv, rope, s)[None].to(x.dtype))
        else:
            q, k, v = attn.project(h, rope)
            for s in spans:
                kk, vv = k[:, :, s.start : s.end], v[:, :, s.start : s.end]
                if s.cache is not None:
                    kk, vv = s.cache.write(kk, vv, s.at)
                outs.append(attn.attention(q[:, :, s.start : s.end], kk, vv, s.mask))
        x = x + attn.o_proj(outs[0] if len(outs) == 1 else torch.cat(outs, dim=1))
        return x + self.mlp(self.post_attention_layernorm(x))

    def _kernel_attention(self, x: torch.Tensor, rope: tuple | None, spans: list[Span]) -> bool:
        """Whether attention runs in the CPU kernel for a model that is not fp32: a bf16 model's rows must not
        depend on the query count (``shared.engine.load_engine``), and torch's bf16 CPU attention is slow anyway.
        fp32 keeps torch's attention: it is what equals transformers."""
        from shared import kernels

        return (x.device.type == "cpu" and x.dtype != torch.float32 and x.shape[0] == 1 and rope is not None
                and not x.requires_grad and all(s.cache is not None for s in spans)
                and kernels.available())  # fmt: skip

    def _attend(self, qkv: torch.Tensor, rope: tuple, s: Span) -> torch.Tensor:
        """Span ``s``'s rows of the fused projections qkv [T, W] (fp32) through the attention kernel: [t, H·d]."""
        heads, kv_heads, head_dim = self._shape
        a, b = s.start, s.end
        k, v = s.cache.storage(s.at + b - a, 1, kv_heads, head_dim, qkv)
        cos, sin = rope[0][0, a:b], rope[1][0, a:b]
        if cos.dtype != torch.float32:
            cos, sin = cos.float(), sin.float()
        return kernels_ops().attend(qkv[a:b], cos, sin, k[0], v[0], s.at, s.mask, heads, kv_heads,
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

    def _forward_int8(self, x: torch.Tensor, rope: tuple, spans: list[Span]) -> torch.Tensor:
        """``forward_spans`` in the CPU kernels (``shared.kernels``): the same block, no per-op Python overhead."""
        _, kv_heads, head_dim = self._shape
        caches = [s.cache.storage(s.at + s.end - s.start, 1, kv_heads, head_dim, x) for s in spans]
        return run_blocks(self._kernel, x[0], rope, [(k[None], v[None]) for k, v in caches], spans)[None]


_NO_MASK = torch.empty(0, dtype=torch.bool)  # what the kernels take for "no mask" and "no bias"
_NO_BIAS = torch.empty(0)


def kernel_blocks(blocks: list[Block]):
    """``blocks`` (consecutive, the same shape) as one ``shared.kernels.Blocks``: a forward through all of
    them crosses into C++ once. None unless every projection of every block is low-bit and the kernels are here."""
    from shared import kernels

    tensors, eps = [], []
    for b in blocks:
        attn, mlp = b.self_attn, b.mlp
        layers = (attn.qkv, attn.o_proj, mlp.gate_up, mlp.down_proj)
        if b.cross or any(m.qweight is None for m in layers) or not kernels.available():
            return None
        ln1, ln2 = b.input_layernorm, b.post_attention_layernorm
        qkv, o, gate_up, down = ((m.qweight, m.qscale, _NO_BIAS if m.bias is None else m.int8_bias()) for m in layers)
        tensors += [ln1.weight.detach(), *qkv, *o, ln2.weight.detach(), *gate_up, *down]
        eps += [ln1.eps, ln2.eps]
    heads, kv_heads, head_dim = blocks[0]._shape
    build = blocks[0].mlp.down_proj.kernel_build
    return kernels.Blocks(tensors, eps, heads, kv_heads, head_dim**-0.5, tag=build)


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
