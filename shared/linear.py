"""The linear layer every model is built of, and its low-bit weights on the CPU kernels.

``Linear`` multiplies rows independently of how many share a call (the engine's exactness rests on it) and can
hold its weight as int8 (a scale per row) or 4-bit Q4_1 blocks, packed in the layout each kernel build streams
(``pack_int8``, ``pack_int4``; a GGUF's own 4-bit blocks by ``pack_int4_blocks``), or a GGUF's k-quants as they are:
Q4_K (``pack_int4k_blocks``) and Q6_K (``pack_int6_blocks``). ``quantize`` makes a whole model's layers low-bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shared.kernels import ops as kernels_ops


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


def _nibble_pairs(v: torch.Tensor) -> torch.Tensor:
    """Values [out, in] as ``pack_int4_blocks`` pairs them: [out / 16, in / 32, 16, 32], step j of a block holding
    each row's values 2j, 2j + 1 side by side, row after row (steps 0-7 go in low nibbles, 8-15 in high ones)."""
    n, k = v.shape
    return v.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).reshape(n // 16, k // 32, 16, 32)


def pack_int4_blocks(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """4-bit values q [out, in] (0..15) with each 32-value block's step d and minimum m [out, in / 32] (value =
    d·q + m; d and m are stored in fp16) in ``pack_int4``'s layout: how a GGUF's own 4-bit blocks are served."""
    n, k = q.shape
    if n % 16 or k % 32 or d.shape != (n, k // 32) or m.shape != d.shape:
        raise ValueError(f"4-bit blocks: values {tuple(q.shape)} (rows in multiples of 16, columns of 32) with "
                         f"scales and minimums [{n}, {k // 32}]; got {tuple(d.shape)}, {tuple(m.shape)}")  # fmt: skip
    d, m = d.half(), m.half()
    pairs = _nibble_pairs(q)
    quants = (pairs[:, :, :8] | (pairs[:, :, 8:] << 4)).reshape(n // 16, k // 32, 256).contiguous()
    dm = torch.stack([d, m], dim=-1).view(n // 16, 16, k // 32, 2).permute(0, 2, 3, 1)
    return quants, dm[..., list(_Q4_SLOTS)].contiguous()


def pack_int4k_blocks(q: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """A GGUF's Q4_K as it is for the CPU kernels (4.5 bits a weight, as in the file): values q [out, in] (0..15), each
    32-value block's 6-bit scale and minimum sc, mn [out, in / 32] and each 256's fp16 d, dmin [out, in / 256]
    (value = d·sc·q − dmin·mn). The values as ``pack_int4_blocks`` lays them out, each block's 16 sc then 16 mn
    after them ([out / 16, in / 32, 288]); d and −dmin apart, [out / 16, in / 256, 2, 16]; columns in the 4-bit
    scales' order. The kernel's step d·sc and minimum −dmin·mn are exact fp32 products: the file's own values."""
    n, k = q.shape
    if n % 16 or k % 256 or sc.shape != (n, k // 32) or mn.shape != sc.shape or d.shape != (n, k // 256) or \
            dmin.shape != d.shape:  # fmt: skip
        raise ValueError(f"Q4_K blocks: values {tuple(q.shape)} (rows in multiples of 16, columns of 256) with "
                         f"scales and minimums [{n}, {k // 32}] and d, dmin [{n}, {k // 256}]; got {tuple(sc.shape)}, "
                         f"{tuple(mn.shape)}, {tuple(d.shape)}, {tuple(dmin.shape)}")  # fmt: skip
    zeros = torch.zeros(n, k // 32)
    quants, _ = pack_int4_blocks(q, zeros, zeros)
    slots = list(_Q4_SLOTS)
    sixes = torch.stack([sc, mn], dim=-1).to(torch.uint8).view(n // 16, 16, k // 32, 2).permute(0, 2, 3, 1)[..., slots]
    packed = torch.cat([quants, sixes.reshape(n // 16, k // 32, 32)], dim=-1).contiguous()
    steps = torch.stack([d.half(), -dmin.half()], dim=-1).view(n // 16, 16, k // 256, 2).permute(0, 2, 3, 1)
    return packed, steps[..., slots].contiguous()


def dequantize_int4k(packed: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [out, in] that ``pack_int4k_blocks``' values and scales stand for (d·sc·q − dmin·mn)."""
    tiles, blocks = packed.shape[:2]
    order = torch.tensor(_Q4_SLOTS).argsort()
    q = unpack_int4(packed[..., :256].contiguous(), torch.zeros(tiles, blocks, 2, 16, dtype=torch.float16))[0]
    sixes = packed[..., 256:].reshape(tiles, blocks, 2, 16)[..., order].permute(0, 3, 1, 2).float()  # [t, 16, b, 2]
    ds = steps[..., order].permute(0, 3, 1, 2).float().repeat_interleave(8, dim=2)  # [t, 16, b, 2]
    per_block = (sixes * ds).reshape(tiles * 16, blocks, 2)
    n, k = q.shape
    return (q.view(n, k // 32, 32).float() * per_block[..., :1] + per_block[..., 1:]).reshape(n, k)


def unpack_int4(quants: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pack_int4_blocks`` undone: the 4-bit values q [out, in] and each 32-value block's step d and minimum m
    [out, in / 32] (fp16)."""
    tiles, blocks = quants.shape[:2]
    groups = quants.view(tiles, blocks, 8, 32)
    pairs = torch.cat([groups & 15, groups >> 4], dim=2).view(tiles, blocks, 16, 16, 2)
    q = pairs.permute(0, 3, 1, 2, 4).reshape(tiles * 16, blocks * 32)
    order = torch.tensor(_Q4_SLOTS).argsort()
    d, m = scales[..., order].permute(0, 3, 1, 2).reshape(tiles * 16, blocks, 2).unbind(-1)
    return q, d, m


def dequantize_int4(quants: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [out, in] that ``pack_int4``'s quants and block scales stand for (d·q + m, in fp32)."""
    q, d, m = unpack_int4(quants, scales)
    n, k = q.shape
    return (q.view(n, k // 32, 32).float() * d.float()[..., None] + m.float()[..., None]).reshape(n, k)


Q6_BYTES = 256 + 128 + 32  # a 6-bit tile's bytes a block: low nibbles, high bits, the two half blocks' scales


def pack_int6_blocks(q: torch.Tensor, scales: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """6-bit values q [out, in] (0..63) with an int8 scale per 16 values [out, in / 16] and an fp16 d per 256 [out,
    in / 256] (value = d·scale·(q − 32): a GGUF's Q6_K, served as it is) in the CPU kernels' layout (``cpu.cpp``'s
    Q6B): per tile of 16 rows and 32-value block, the low 4 bits as ``pack_int4_blocks`` lays them out, their high 2
    bits (byte i: those of 4-bit byte i's two values, then of byte i + 128's) and the two half blocks' scales;
    the d apart, [out / 16, in / 256, 16]. Scales and d in the 4-bit scales' column order."""
    n, k = q.shape
    if n % 16 or k % 256 or scales.shape != (n, k // 16) or d.shape != (n, k // 256):
        raise ValueError(f"6-bit blocks: values {tuple(q.shape)} (rows in multiples of 16, columns of 256) with "
                         f"scales [{n}, {k // 16}] and d [{n}, {k // 256}]; got {tuple(scales.shape)}, "
                         f"{tuple(d.shape)}")  # fmt: skip
    q = q.to(torch.uint8)
    low, high = _nibble_pairs(q & 15), _nibble_pairs(q >> 4)
    quants = (low[:, :, :8] | (low[:, :, 8:] << 4)).reshape(n // 16, k // 32, 256)
    bits = (high[:, :, :8] | (high[:, :, 8:] << 2)).reshape(n // 16, k // 32, 256)
    bits = bits[..., :128] | (bits[..., 128:] << 4)
    slots = list(_Q4_SLOTS)
    sc = scales.to(torch.int8).view(n // 16, 16, k // 32, 2).permute(0, 2, 3, 1)[..., slots]
    packed = torch.cat([quants, bits, sc.reshape(n // 16, k // 32, 32).view(torch.uint8)], dim=-1).contiguous()
    return packed, d.half().view(n // 16, 16, k // 256).transpose(1, 2)[..., slots].contiguous()


def unpack_int6(packed: torch.Tensor, dsup: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pack_int6_blocks`` undone: q [out, in] (0..63), the scales [out, in / 16] (int8), d [out, in / 256]."""
    tiles, blocks = packed.shape[:2]
    order = torch.tensor(_Q4_SLOTS).argsort()
    no_scales = torch.zeros(tiles, blocks, 2, 16, dtype=torch.float16)
    low = unpack_int4(packed[..., :256].contiguous(), no_scales)[0]
    bits = packed[..., 256:384]
    bits = torch.cat([bits & 15, bits >> 4], dim=-1)  # each 4-bit byte's two values' high bits, in its place
    high = unpack_int4(((bits & 3) | ((bits >> 2) << 4)).contiguous(), no_scales)[0]
    q = low | (high << 4)
    sc = packed[..., 384:].contiguous().view(torch.int8).view(tiles, blocks, 2, 16)[..., order]
    scales = sc.permute(0, 3, 1, 2).reshape(tiles * 16, blocks * 2)
    d = dsup[..., order].transpose(1, 2).reshape(tiles * 16, -1)
    return q, scales, d


def dequantize_int6(packed: torch.Tensor, dsup: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [out, in] that ``pack_int6_blocks``' values and scales stand for (d·scale·(q − 32))."""
    q, scales, d = unpack_int6(packed, dsup)
    n, k = q.shape
    step = d.float().repeat_interleave(16, dim=1) * scales.float()  # d·scale per 16 values, exact in fp32
    return (step.repeat_interleave(16, dim=1) * (q.float() - 32)).view(n, k)


BF16_ROWS = 16  # a bf16 GEMM on a CPU multiplies exactly this many rows per call (see ``Linear``)


class Linear(nn.Linear):
    """``nn.Linear`` whose rows do not depend on how many rows are multiplied together, optionally int8.

    A bf16 GEMM on a CPU rounds a row differently depending on how many rows share the call (oneDNN picks its
    kernel and blocking by shape: on a Zen 5 a single row with K = 1536 went another way; on an Intel CPU with
    AMX, torch 2.13, rows differ between M = 2, 16, 32 and 64 for SmolLM2's head): plain decoding (one token)
    then drifts from tree verification (many) and greedy outputs part at near-ties. So bf16 rows on a CPU are
    multiplied in blocks of exactly ``BF16_ROWS`` (the last padded with zero rows): every row goes through the
    same call shape, whatever the forward. A forward of up to ``BF16_ROWS`` tokens is one call (one token: ~1.05x
    its own cost on AMX, the weights are streamed once either way); a prefill is several (~2.5x). fp32 rows are
    left alone: MKL's single-row path is a fast GEMV, and fp32 exactness is against transformers, within ties.

    ``quantize`` makes it low-bit on a CPU (``shared.kernels``): ``int8`` weights with one scale per output
    row (each input row quantised to int8 with its own scale: one exact integer sum a dot product), or
    ``int4`` (Q4_1 blocks of 32, fp16 scale and minimum each: ``pack_int4``; input rows quantised with a
    scale per 32-value block, every block's sum exact). A quarter (an eighth) of fp32's bytes to stream,
    and a row's result is the same whatever rows share the call.
    """

    qweight: torch.Tensor | None = None  # int8 in its kernel build's layout (pack_int8), or int4 quants (pack_int4)
    kernel_build: str | None = None  # the kernel build that packed it (``shared.kernels``)
    qscale: torch.Tensor | None = None  # fp32 [out], or int4 block scales

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # the output rows after qweight's, packed in another block format: a GGUF projection fused from tensors of
        # two kinds (q and k in Q4_K, v in Q6_K), each served as it is; this layer's bias covers both
        self.tail: Linear | None = None

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
        """``native``, ``int8``, ``int4`` (Q4_1 or Q4_K blocks) or ``int6``: what this layer's own rows compute
        with (a ``tail`` says its own)."""
        if self.qweight is None:
            return "native"
        if self.qweight.dtype != torch.uint8:
            return "int8"
        return "int6" if self.qweight.shape[-1] == Q6_BYTES else "int4"

    def cuttable(self) -> bool:
        """Whether ``rows`` can cut this layer without rounding again: float, or Q4_1-style 4-bit blocks."""
        return self.qweight is None or (
            self.tail is None and self.qweight.dtype == torch.uint8 and self.qweight.shape[-1] == 256
        )

    def _apply(self, fn, recurse=True):
        module = super()._apply(fn, recurse)
        if self.qweight is not None:  # follow device moves; the int8 matrix and its fp32 scales keep their dtypes
            device = fn(torch.empty(0)).device
            self.qweight, self.qscale = self.qweight.to(device), self.qscale.to(device)
        return module

    def rows(self, ids: torch.Tensor, chunk: int = 1024) -> Linear:
        """A layer of only the output rows ``ids`` (in that order) that computes what this one computes for them: a
        float weight's rows, or 4-bit quants and block scales copied as they are (of the tiles of 16 rows holding
        them, ``chunk`` tiles unpacked at a time), padded with zero rows to the kernels' tile of 16 — its first
        ``len(ids)`` outputs are the rows asked for. An int8 layer keeps no copy it could cut rows from without
        rounding again."""
        ids = torch.as_tensor(ids, dtype=torch.long).cpu()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.out_features):
            raise ValueError(f"rows {int(ids.min())}..{int(ids.max())} of a layer of {self.out_features} outputs")
        rows = -(-len(ids) // 16) * 16
        sub = Linear(self.in_features, rows, bias=self.bias is not None, device="meta")
        if self.bias is not None:
            sub.bias = nn.Parameter(F.pad(self.bias.detach()[ids.to(self.bias.device)], (0, rows - len(ids))))
        if self.weight is not None:
            sub.weight = nn.Parameter(F.pad(self.weight.detach()[ids.to(self.weight.device)],
                                            (0, 0, 0, rows - len(ids))))  # fmt: skip
            return sub
        if not self.cuttable():
            raise ValueError(f"an {self.weights_kind()} layer of {tuple(self.qweight.shape)} packed values is not cut "
                             "into rows (only float layers and Q4_1-style 4-bit ones are)")  # fmt: skip
        sub.weight = None
        k = self.qweight.shape[1] * 32  # columns as packed (blocks of 32)
        q = torch.zeros(rows, k, dtype=torch.uint8)
        d = torch.zeros(rows, k // 32, dtype=torch.float16)
        m = torch.zeros_like(d)
        tiles = torch.unique(ids // 16)  # only the tiles that hold a row asked for are unpacked
        for i in range(0, len(tiles), chunk):
            some = tiles[i : i + chunk]
            cq, cd, cm = unpack_int4(self.qweight[some.to(self.qweight.device)].cpu(),
                                     self.qscale[some.to(self.qscale.device)].cpu())  # fmt: skip
            inside = ((ids // 16 >= some[0]) & (ids // 16 <= some[-1])).nonzero().flatten()
            local = torch.searchsorted(some, ids[inside] // 16) * 16 + ids[inside] % 16
            q[inside], d[inside], m[inside] = cq[local], cd[local], cm[local]
        sub.qweight, sub.qscale = pack_int4_blocks(q, d, m)
        sub.qweight, sub.qscale = sub.qweight.to(self.qweight.device), sub.qscale.to(self.qscale.device)
        sub.kernel_build = self.kernel_build
        return sub

    def float_rows(self, ids: torch.Tensor, chunk: int = 512) -> torch.Tensor:
        """The fp32 weight rows ``ids`` [len(ids), in]: the float weight's, or what this layer's 4- or 6-bit blocks
        stand for (the tiles of 16 rows holding them unpacked, ``chunk`` tiles at a time) — the values its kernels
        compute with, for a drafter that borrows a few thousand rows of a low-bit head. An int8 layer's packing
        depends on its kernel build, and a fused one holds two formats: neither is unpacked here."""
        ids = torch.as_tensor(ids, dtype=torch.long).cpu()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.out_features):
            raise ValueError(f"rows {int(ids.min())}..{int(ids.max())} of a layer of {self.out_features} outputs")
        if self.weight is not None:
            return self.weight.detach()[ids.to(self.weight.device)].float()
        width = self.qweight.shape[-1] if self.qweight.dtype == torch.uint8 else None
        unpack = {256: dequantize_int4, 256 + 32: dequantize_int4k, Q6_BYTES: dequantize_int6}.get(width)
        if unpack is None or self.tail is not None:
            raise ValueError(f"an {self.weights_kind()} layer of {tuple(self.qweight.shape)} packed values"
                             f"{' and a tail' if self.tail is not None else ''} is not unpacked into float rows")
        out = torch.empty(len(ids), self.in_features)
        tiles = torch.unique(ids // 16)
        for i in range(0, len(tiles), chunk):
            some = tiles[i : i + chunk]
            block = unpack(self.qweight[some.to(self.qweight.device)].cpu(), self.qscale[some.to(self.qscale.device)]
                           .cpu())  # fmt: skip
            inside = ((ids // 16 >= some[0]) & (ids // 16 <= some[-1])).nonzero().flatten()
            out[inside] = block[torch.searchsorted(some, ids[inside] // 16) * 16 + ids[inside] % 16]
        return out.to(self.qscale.device)

    def int8_biases(self) -> list[torch.Tensor | None]:
        """The fp32 bias of this layer's own rows, and of its tail's if it has one, as the kernels take them."""
        own = self.out_features - (0 if self.tail is None else self.tail.out_features)
        bias = None if self.bias is None else self.bias.detach().float()
        if self.tail is None:
            return [None if bias is None else bias.contiguous()]
        return [None, None] if bias is None else [bias[:own].contiguous(), bias[own:].contiguous()]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            if x.device.type != "cpu":
                raise RuntimeError(f"a low-bit layer computes on the CPU; its input is on {x.device}")
            if x.shape[-1] != self.in_features:  # the kernel sees only the padded width
                raise ValueError(f"input of width {x.shape[-1]} for a layer of {self.in_features} inputs")
            linear = kernels_ops(self.kernel_build).linear
            parts = [self] if self.tail is None else [self, self.tail]
            out = [linear(x.float(), p.qweight, p.qscale, b, None) for p, b in zip(parts, self.int8_biases(),
                                                                                    strict=True)]  # fmt: skip
            return torch.cat(out, dim=-1).to(x.dtype) if len(out) > 1 else out[0].to(x.dtype)
        if x.device.type != "cpu" or x.dtype != torch.bfloat16:
            return F.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, x.shape[-1])
        count = rows.shape[0]
        if count % BF16_ROWS:
            rows = torch.cat([rows, rows.new_zeros(BF16_ROWS - count % BF16_ROWS, rows.shape[1])])
        blocks = [F.linear(rows[i : i + BF16_ROWS], self.weight, self.bias) for i in range(0, len(rows), BF16_ROWS)]
        out = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
        return out[:count].view(*x.shape[:-1], -1)


def quantize(module: nn.Module, kind: str = "int8", skip: tuple[nn.Module, ...] = ()) -> int:
    """Make every :class:`Linear` under ``module`` (but those in ``skip``) ``int8`` or ``int4``; how many."""
    count = 0
    for m in module.modules():
        if isinstance(m, Linear) and m.qweight is None and not any(m is s for s in skip):
            m.quantize(kind)
            count += 1
    return count
