"""The CPU kernels' weight layouts, numeric only: packing a weight (or a GGUF's own blocks) into them and back.

int8 with one scale per row (``pack_int8``, in the layout a kernel build streams), 4-bit Q4_1 blocks (``pack_int4``;
a GGUF's own 4-bit blocks by ``pack_int4_blocks``), and a GGUF's k-quants as they are: Q4_K (``pack_int4k_blocks``)
and Q6_K (``pack_int6_blocks``); each with the fp32 weight its values stand for (``dequantize_*``). What computes
with them is ``kernels``; the layer that holds them, ``linear.Linear``.
"""

from __future__ import annotations

import torch


def pack_int8(weight: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [out, in] as the CPU kernels take it: int8 with one fp32 scale per row (max |w| / 127), columns
    padded to 32 with zeros, laid out in the order a kernel build streams it (``layout``: a build's
    ``int8_layout()``, e.g. ``kernels.ops().int8_layout()`` for the active one). ``rows4`` (AVX2, portable): tiles
    of 4 rows whose 32-value steps lie together, as a matrix [out padded to 4, in]; ``cols16`` (AVX-512 VNNI): tiles
    of 16 rows, each 4 values of a row together and the 16 rows side by side, [out / 16, in / 4, 16, 4] (a 32-bit
    lane is one output)."""
    if layout not in ("rows4", "cols16"):
        raise ValueError(f"unknown int8 layout {layout!r}; expected rows4 or cols16")
    w = weight.detach().float().cpu()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127
    tile = 4 if layout == "rows4" else 16
    rows, cols = -(-w.shape[0] // tile) * tile, -(-w.shape[1] // 32) * 32
    q = torch.zeros(rows, cols, dtype=torch.int8)
    q[: w.shape[0], : w.shape[1]] = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    return lay_int8(q, layout), scale.contiguous()


def lay_int8(q: torch.Tensor, layout: str) -> torch.Tensor:
    """int8 values [rows, cols] (rows a multiple of the layout's tile, cols of 32) in ``layout`` (``pack_int8``)."""
    rows, cols = q.shape
    if layout == "rows4":
        return q.view(rows // 4, 4, cols // 32, 32).transpose(1, 2).contiguous().view(rows, cols)
    return q.view(rows // 16, 16, cols // 4, 4).transpose(1, 2).contiguous()


def int8_layout(packed: torch.Tensor) -> str:
    """The layout a packed int8 weight is in: ``cols16``'s tiles are a dimension of their own."""
    return "cols16" if packed.dim() == 4 else "rows4"


def int8_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of a packed int8 weight (``pack_int8``, either layout) as values [len(ids), cols]: one gather,
    the rest of the matrix untouched."""
    if int8_layout(packed) == "cols16":
        return packed[ids // 16, :, ids % 16, :].reshape(len(ids), -1)
    rows, cols = packed.shape
    return packed.view(rows // 4, cols // 32, 4, 32)[ids // 4, :, ids % 4, :].reshape(len(ids), cols)


# the column order of a 4-bit tile's scales: the order the kernel's widened int16 sums come in (``cpu.cpp``'s gemm_q4)
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
