"""The payload codec: tensors the server sends the client's drafter, quantised and compressed.

Both sides use this one module. A payload is a small header then a zstandard frame:

    magic "SSPL" | version u8 | precision u8 | ndim u8 | shape u32 x ndim | body length u32 | crc32 u32 | zstd(body)

``precision`` picks the body: ``fp32``/``fp16`` raw, or ``int8``/``int4`` with one fp16 scale per
row (the last dimension is a row): x ≈ q · scale with scale = max|row| / 127 (or / 7), so each
element is off by at most scale / 2. int4 packs two values per byte. The header says everything
needed to decode, and the CRC (over the compressed body) catches corruption before zstd does.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np
import torch
import zstandard

from shared.errors import SplitspecError

MAGIC = b"SSPL"
VERSION = 1
PRECISIONS = ("fp32", "fp16", "int8", "int4")
LEVELS = {"fp32": 127, "fp16": 127, "int8": 127, "int4": 7}  # max |q| (fp: unused)
MAX_ELEMENTS = 1 << 31  # refuse headers that promise absurd sizes before allocating anything
_HEAD = struct.Struct("<4sBBB")
_TAIL = struct.Struct("<II")


class CodecError(SplitspecError):
    """A payload that cannot be decoded: corrupted, truncated, another version, or not the shape expected."""


def _rows(t: torch.Tensor) -> np.ndarray:
    flat = t.detach().to("cpu", torch.float32).contiguous().numpy()
    return flat.reshape(-1, flat.shape[-1]) if flat.ndim else flat.reshape(1, 1)


def encode(tensor: torch.Tensor, precision: str = "fp16", level: int = 3) -> bytes:
    """Quantise (per row for int8/int4) and compress; the result decodes to ``tensor``'s shape."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    shape = tuple(tensor.shape)
    if precision == "fp32":
        body = _rows(tensor).astype("<f4").tobytes()
    elif precision == "fp16":
        body = _rows(tensor).astype("<f2").tobytes()
    else:
        rows = _rows(tensor)
        top = LEVELS[precision]
        scale = np.abs(rows).max(axis=1, keepdims=True) / top if rows.size else np.zeros((rows.shape[0], 1))
        scale = scale.astype(np.float16)
        safe = np.where(scale == 0, 1.0, scale.astype(np.float32))
        q = np.clip(np.rint(rows / safe), -top, top).astype(np.int8)
        if precision == "int4":
            q = _pack4(q)
        body = scale.astype("<f2").tobytes() + q.tobytes()
    packed = zstandard.ZstdCompressor(level=level).compress(body)
    head = _HEAD.pack(MAGIC, VERSION, PRECISIONS.index(precision), len(shape))
    dims = struct.pack(f"<{len(shape)}I", *shape)
    return head + dims + _TAIL.pack(len(body), zlib.crc32(packed)) + packed


def decode(blob: bytes, expect_shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """The float32 tensor inside ``blob``; CodecError names what is wrong with a bad one."""
    view = memoryview(blob)
    if len(view) < _HEAD.size:
        raise CodecError(f"payload of {len(view)} bytes is shorter than its header")
    magic, version, code, ndim = _HEAD.unpack_from(view)
    if magic != MAGIC:
        raise CodecError(f"not a splitspec payload (magic {bytes(magic)!r}, expected {MAGIC!r})")
    if version != VERSION:
        raise CodecError(f"payload version {version}, this side speaks version {VERSION}")
    if code >= len(PRECISIONS):
        raise CodecError(f"unknown payload precision code {code}")
    precision = PRECISIONS[code]
    offset = _HEAD.size
    if len(view) < offset + 4 * ndim + _TAIL.size:
        raise CodecError("payload truncated inside its header")
    shape = struct.unpack_from(f"<{ndim}I", view, offset)
    offset += 4 * ndim
    body_len, crc = _TAIL.unpack_from(view, offset)
    offset += _TAIL.size
    if expect_shape is not None and tuple(shape) != tuple(expect_shape):
        raise CodecError(f"payload shape {tuple(shape)}, expected {tuple(expect_shape)}")
    count = int(np.prod(shape)) if ndim else 1
    cols = shape[-1] if ndim else 1
    rows = count // cols if cols else 0
    want = _body_length(precision, rows, cols)
    if count > MAX_ELEMENTS or body_len != want:
        raise CodecError(
            f"payload header is inconsistent: {precision} {tuple(shape)} needs {want} bytes, it says {body_len}"
        )
    packed = view[offset:]
    if zlib.crc32(packed) != crc:
        raise CodecError("payload corrupted or truncated (CRC mismatch)")
    try:
        body = zstandard.ZstdDecompressor().decompress(packed, max_output_size=body_len)
    except zstandard.ZstdError as exc:
        raise CodecError(f"payload does not decompress: {exc}") from None
    if len(body) != body_len:
        raise CodecError(f"payload body is {len(body)} bytes, header says {body_len}")
    if precision in ("fp32", "fp16"):
        values = np.frombuffer(body, dtype="<f4" if precision == "fp32" else "<f2").astype(np.float32)
    else:
        scale = np.frombuffer(body, dtype="<f2", count=rows).astype(np.float32).reshape(rows, 1)
        q = np.frombuffer(body, dtype=np.int8, offset=2 * rows)
        q = _unpack4(q, cols) if precision == "int4" else q.reshape(rows, cols)
        values = (q.astype(np.float32) * scale).reshape(-1)
    return torch.from_numpy(values.copy()).reshape(shape)


def _body_length(precision: str, rows: int, cols: int) -> int:
    if precision == "fp32":
        return 4 * rows * cols
    if precision == "fp16":
        return 2 * rows * cols
    per_row = cols if precision == "int8" else (cols + 1) // 2
    return 2 * rows + rows * per_row


def _pack4(q: np.ndarray) -> np.ndarray:
    """Two signed 4-bit values per byte (low nibble first); an odd row gets a zero pad."""
    if q.shape[1] % 2:
        q = np.concatenate([q, np.zeros((q.shape[0], 1), dtype=np.int8)], axis=1)
    u = (q + 8).astype(np.uint8)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).astype(np.uint8)


def _unpack4(packed: np.ndarray, cols: int) -> np.ndarray:
    rows = packed.size // ((cols + 1) // 2) if cols else 0
    p = packed.view(np.uint8).reshape(rows, (cols + 1) // 2)
    out = np.empty((rows, 2 * p.shape[1]), dtype=np.int8)
    out[:, 0::2] = (p & 0x0F).astype(np.int8) - 8
    out[:, 1::2] = (p >> 4).astype(np.int8) - 8
    return out[:, :cols]


def error_bound(tensor: torch.Tensor, precision: str) -> torch.Tensor:
    """Per-element worst-case error of ``precision`` on ``tensor`` (0 for fp32; fp16 rounding for fp16)."""
    x = tensor.detach().float()
    if precision == "fp32":
        return torch.zeros_like(x)
    if precision == "fp16":
        return x.abs() * 2**-11 + 2**-24
    top = LEVELS[precision]
    row_max = x.abs().amax(dim=-1, keepdim=True) if x.dim() else x.abs()
    return (row_max / top) * (0.5 + 2**-10) + 2**-24  # half a step, plus the fp16 rounding of the scale
