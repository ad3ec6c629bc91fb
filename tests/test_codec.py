"""The payload codec: exact where it must be, within its bound where it quantises, loud when a payload is bad."""

from __future__ import annotations

import struct

import pytest
import torch

from shared.codec import PRECISIONS, CodecError, decode, encode, error_bound


@pytest.fixture
def kv() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 30, 384, generator=g) * torch.linspace(0.1, 20, 384)  # rows of very different scales
    x[3, 4] = 0.0  # an all-zero row
    return x


def test_fp16_is_exact_for_fp16_input(kv):
    x = kv.half().float()
    assert torch.equal(decode(encode(x, "fp16")), x)
    assert torch.equal(decode(encode(kv, "fp32")), kv)


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_quantised_payloads_stay_within_their_bound(kv, precision):
    out = decode(encode(kv, precision), expect_shape=kv.shape)
    assert out.shape == kv.shape and out.dtype == torch.float32
    assert ((out - kv).abs() <= error_bound(kv, precision)).all()
    assert torch.equal(out[3, 4], torch.zeros(384))


@pytest.mark.parametrize("shape", [(5,), (2, 3, 7), (0, 4), (4, 1), (3, 9)])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_shapes_round_trip(shape, precision):
    x = torch.randn(shape)
    out = decode(encode(x, precision))
    assert out.shape == x.shape
    assert ((out - x).abs() <= error_bound(x, precision)).all()


def test_smaller_precisions_are_smaller(kv):
    sizes = {p: len(encode(kv, p)) for p in PRECISIONS}
    assert sizes["fp32"] > sizes["fp16"] > sizes["int8"] > sizes["int4"]
    assert sizes["int4"] < 0.3 * sizes["fp16"]


def test_bad_payloads_are_named(kv):
    blob = encode(kv, "int8")
    with pytest.raises(CodecError, match="CRC"):
        corrupt = bytearray(blob)
        corrupt[-10] ^= 0xFF
        decode(bytes(corrupt))
    with pytest.raises(CodecError, match="truncated|CRC"):
        decode(blob[: len(blob) // 2])
    with pytest.raises(CodecError, match="shorter than its header"):
        decode(blob[:3])
    with pytest.raises(CodecError, match="version 9"):
        decode(blob[:4] + bytes([9]) + blob[5:])
    with pytest.raises(CodecError, match="not a splitspec payload"):
        decode(b"XXXX" + blob[4:])
    with pytest.raises(CodecError, match=r"shape \(7, 30, 384\), expected \(7, 30, 383\)"):
        decode(blob, expect_shape=(7, 30, 383))
    lying = bytearray(blob)
    struct.pack_into("<I", lying, 7, 1 << 30)  # a first dimension that promises far more data than there is
    with pytest.raises(CodecError, match="inconsistent"):
        decode(bytes(lying))
    with pytest.raises(ValueError, match="precision"):
        encode(kv, "int2")
