"""The linear layer every model is built of, and its low-bit weights on the CPU kernels.

``Linear`` multiplies rows independently of how many share a call (the engine's exactness rests on it) and can
hold its weight as int8 (a scale per row) or 4-bit Q4_1 blocks, packed in the layout each kernel build streams
(``quant.pack_int8``, ``quant.pack_int4``; a GGUF's own 4-bit blocks by ``quant.pack_int4_blocks``), or a GGUF's
k-quants as they are: Q4_K (``quant.pack_int4k_blocks``) and Q6_K (``quant.pack_int6_blocks``). ``quantize`` makes a
whole model's layers low-bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shared.engine import kernels
from shared.engine.quant import (
    Q6_BYTES,
    dequantize_int4,
    dequantize_int4k,
    dequantize_int6,
    int8_layout,
    int8_rows,
    lay_int8,
    pack_int4,
    pack_int4_blocks,
    pack_int8,
    unpack_int4,
)

BF16_ROWS = 16  # a bf16 GEMM on a CPU multiplies exactly this many rows per call (see ``Linear``)
# the same for an exact target on a GPU (``exact_rows``): on a GPU a projection of 64 rows costs about what one does
# (the weights' bytes are the cost), so one shape for every call costs a single row nothing
CUDA_ROWS = 64


class Linear(nn.Linear):
    """``nn.Linear`` whose rows do not depend on how many rows are multiplied together, optionally int8.

    A bf16 GEMM on a CPU rounds a row differently depending on how many rows share the call (oneDNN picks its
    kernel and blocking by shape, docs/engine.md "Exact at every dtype"): plain decoding (one token)
    then drifts from tree verification (many) and greedy outputs part at near-ties. So bf16 rows on a CPU are
    multiplied in blocks of exactly ``BF16_ROWS`` (the last padded with zero rows): every row goes through the
    same call shape, whatever the forward. A forward of up to ``BF16_ROWS`` tokens is one call (the weights are
    streamed once either way); a prefill is several. fp32 rows are
    left alone: MKL's single-row path is a fast GEMV, and fp32 exactness is against transformers, within ties.

    ``quantize`` makes it low-bit on a CPU (``shared.engine.kernels``): ``int8`` weights with one scale per output
    row (each input row quantised to int8 with its own scale: one exact integer sum a dot product), or
    ``int4`` (Q4_1 blocks of 32, fp16 scale and minimum each: ``pack_int4``; input rows quantised with a
    scale per 32-value block, every block's sum exact). A quarter (an eighth) of fp32's bytes to stream,
    and a row's result is the same whatever rows share the call.
    """

    qweight: torch.Tensor | None = None  # int8 in its kernel build's layout (pack_int8), or int4 quants (pack_int4)
    exact_rows: int = 0  # bf16 rows multiplied in fixed blocks of this many, whatever the device (0: a CPU's only)
    kernel_build: str | None = None  # the kernel build that packed it (``shared.engine.kernels``)
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
        if self.weight.device.type != "cpu":
            raise ValueError(f"low-bit weights are a CPU path; this layer is on {self.weight.device}")
        if not kernels.available():
            raise ValueError(f"low-bit weights need splitspec's CPU kernels: {kernels.unavailable_reason()}")
        fits = self.out_features % 16 == 0 and self.in_features % 32 == 0
        packed = pack_int4(self.weight) if kind in ("int4", "lowbit") and fits else None
        if kind == "lowbit" and packed is not None and not torch.equal(dequantize_int4(*packed), self.weight.float()):
            packed = None  # not on a Q4_1 grid: int4 would change the weights, int8 changes them least
        self.qweight, self.qscale = packed or pack_int8(self.weight, kernels.ops().int8_layout())
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
        """Whether ``rows`` can cut this layer without rounding again: float, int8 (a scale a row), or Q4_1-style
        4-bit blocks."""
        return self.qweight is None or (self.tail is None and self.weights_kind() == "int8") or (
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
        float weight's rows, int8 rows and their scales, or 4-bit quants and block scales copied as they are (of the
        tiles of 16 rows holding them, ``chunk`` tiles unpacked at a time), padded with zero rows to the kernels' tile
        of 16 — its first ``len(ids)`` outputs are the rows asked for. Q4_K and Q6_K rows share a super-block's
        scales with their tile, and are not cut."""
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
                             "into rows (only float, int8 and Q4_1-style 4-bit ones are)")  # fmt: skip
        sub.weight, sub.kernel_build = None, self.kernel_build
        if self.weights_kind() == "int8":  # a row is its int8 values and its scale: moved, never rounded
            q = F.pad(int8_rows(self.qweight.cpu(), ids), (0, 0, 0, rows - len(ids)))
            sub.qweight = lay_int8(q, int8_layout(self.qweight)).to(self.qweight.device)
            sub.qscale = F.pad(self.qscale.detach().cpu()[ids], (0, rows - len(ids))).to(self.qscale.device)
            return sub
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
            linear = kernels.ops(self.kernel_build).linear
            parts = [self] if self.tail is None else [self, self.tail]
            out = [linear(x.float(), p.qweight, p.qscale, b, None) for p, b in zip(parts, self.int8_biases(),
                                                                                    strict=True)]  # fmt: skip
            return torch.cat(out, dim=-1).to(x.dtype) if len(out) > 1 else out[0].to(x.dtype)
        block = self.exact_rows or (BF16_ROWS if x.device.type == "cpu" else 0)
        if x.dtype != torch.bfloat16 or not block:
            return F.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, x.shape[-1])
        count = rows.shape[0]
        if count % block:
            rows = torch.cat([rows, rows.new_zeros(block - count % block, rows.shape[1])])
        blocks = [F.linear(rows[i : i + block], self.weight, self.bias) for i in range(0, len(rows), block)]
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
