"""The CPU kernels (shared/engine/kernels): exact integer linear layers, and rows that never depend on their batch."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from shared.engine import kernels
from shared.engine.quant import (
    dequantize_int4,
    dequantize_int4k,
    dequantize_int6,
    pack_int4,
    pack_int4k_blocks,
    pack_int6_blocks,
    pack_int8,
    unpack_int6,
)
from shared.tree import path_to, tree_mask

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"no CPU kernels: {kernels.unavailable_reason()}")
ops = kernels.ops() if kernels.available() else None


def pack_int8_active(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``pack_int8`` in the layout of the build ``ops`` belongs to."""
    return pack_int8(weight, ops.int8_layout())


def int8_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What the linear kernel must compute, in torch: each row quantised on its own, exact integer dot
    products (int64 here), then the same fp32 scaling."""
    amax = x.abs().amax(dim=1, keepdim=True)
    xq = torch.round(x * (127 / amax)).clamp(-127, 127).to(torch.int64)
    w_scale = weight.abs().amax(dim=1).clamp_min(1e-12) / 127
    wq = (weight / w_scale[:, None]).round().clamp(-127, 127).to(torch.int64)
    acc = (xq @ wq.T).to(torch.float32)
    return acc * ((amax / 127) * w_scale)


@pytest.mark.parametrize("n, k", [(96, 64), (37, 50), (1538, 576)])
def test_linear_is_the_exact_integer_product(n, k):
    """Odd sizes too: rows padded to the kernel's tiles with zeros change nothing."""
    torch.manual_seed(n)
    weight, x = torch.randn(n, k) * 0.05, torch.randn(9, k)
    q, scale = pack_int8_active(weight)
    got = ops.linear(x, q, scale, None, None)
    assert torch.equal(got, int8_reference(x, weight))
    bias, residual = torch.randn(n), torch.randn(9, n)
    torch.testing.assert_close(ops.linear(x, q, scale, bias, residual), got + bias + residual)
    assert (got - x @ weight.T).abs().max() < 0.03 * (x @ weight.T).abs().max()  # and close to fp32


def test_int4_is_exact_on_its_blocks_and_gives_back_q4_1_weights():
    """int4: each block's integer dot product is exact (fp64 reference on the dequantised weight and the block-wise
    quantised activations, within fp32 rounding of the block sums), and weights that already are Q4_1 (the built-in
    GGUF's) pack to themselves."""
    torch.manual_seed(3)
    weight, x = torch.randn(64, 96) * 0.05, torch.randn(6, 96)
    quants, scales = pack_int4(weight)
    dequantised = dequantize_int4(quants, scales)
    assert (dequantised - weight).abs().max() <= weight.abs().max() / 15  # half a step of the widest block
    blocks = x.view(6, 3, 32)  # int4's activations: a scale per 32-value block (Q8)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    xq = (torch.round(blocks * (127 / amax)).clamp(-127, 127) * (amax / 127)).view(6, 96).double()
    want = xq @ dequantised.double().T
    got = ops.linear(x, quants, scales, None, None)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    again = pack_int4(dequantised)
    assert torch.equal(again[0], quants) and torch.equal(again[1], scales)
    with pytest.raises(ValueError, match="multiples of 16"):
        pack_int4(torch.randn(6, 64))


def random_int6(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random Q6_K-like 6-bit weights [n, k] packed for the kernels: every value, scale (-128..127 too) and d."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 64, (n, k), dtype=torch.uint8, generator=gen)
    scales = torch.randint(-128, 128, (n, k // 16), generator=gen).to(torch.int8)
    return pack_int6_blocks(q, scales, (torch.rand(n, k // 256, generator=gen) * 2e-3).half())


def random_int4k(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random Q4_K weights [n, k] packed for the kernels: values, 6-bit scales and minimums, fp16 d and dmin."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    sc, mn = (torch.randint(0, 64, (n, k // 32), generator=gen) for _ in range(2))
    d, dmin = ((torch.rand(n, k // 256, generator=gen) * 1e-3).half() for _ in range(2))
    return pack_int4k_blocks(q, sc, mn, d, dmin)


def pack_int4k(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Random Q4_K weights of ``weight``'s shape (its columns padded to 256)."""
    return random_int4k(weight.shape[0], -(-weight.shape[1] // 256) * 256, seed=weight.shape[0])


def test_int4_from_q4_k_is_exact_on_its_blocks():
    """Q4_K's blocks as they are: the kernel's step and minimum are d·sc and -dmin·mn in fp32, so its product is the
    fp64 one of exactly the file's values and the block-wise quantised activations."""
    gen = torch.Generator().manual_seed(8)
    q = torch.randint(0, 16, (32, 512), dtype=torch.uint8, generator=gen)
    sc, mn = (torch.randint(0, 64, (32, 16), generator=gen) for _ in range(2))
    d, dmin = ((torch.rand(32, 2, generator=gen) * 1e-3).half() for _ in range(2))
    packed = pack_int4k_blocks(q, sc, mn, d, dmin)
    weight = dequantize_int4k(*packed)
    per_block = lambda a, b: a.float().repeat_interleave(256, 1) * b.float().repeat_interleave(32, 1)  # noqa: E731
    assert torch.equal(weight, per_block(d, sc) * q.float() - per_block(dmin, mn))
    x = torch.randn(7, 512)
    blocks = x.view(7, 16, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    xq = (torch.round(blocks * (127 / amax)).clamp(-127, 127) * (amax / 127)).view(7, 512).double()
    torch.testing.assert_close(ops.linear(x, *packed, None, None).double(), xq @ weight.double().T, atol=1e-5,
                               rtol=1e-5)  # fmt: skip


def pack_int6(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Random 6-bit weights of ``weight``'s shape (its columns padded to 256): what the tests below multiply by."""
    return random_int6(weight.shape[0], -(-weight.shape[1] // 256) * 256, seed=weight.shape[0])


def test_int6_is_exact_on_its_half_blocks_and_packs_a_gguf_q6_k_as_it_is():
    """int6 (a GGUF's Q6_K): values, 16-value scales and super-block d come back unpacked as they went in, and the
    kernel's product is the fp64 one of the weight they stand for and the block-wise quantised activations."""
    torch.manual_seed(4)
    gen = torch.Generator().manual_seed(4)
    q = torch.randint(0, 64, (48, 512), dtype=torch.uint8, generator=gen)
    scales = torch.randint(-128, 128, (48, 32), generator=gen).to(torch.int8)
    d = (torch.rand(48, 2, generator=gen) * 1e-3).half()
    packed = pack_int6_blocks(q, scales, d)
    assert all(torch.equal(a, b) for a, b in zip(unpack_int6(*packed), (q, scales, d), strict=True))
    weight = dequantize_int6(*packed)
    want_weight = d.float().repeat_interleave(256, 1) * scales.float().repeat_interleave(16, 1) * (q.float() - 32)
    assert torch.equal(weight, want_weight)
    x = torch.randn(9, 512)
    blocks = x.view(9, 16, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    xq = (torch.round(blocks * (127 / amax)).clamp(-127, 127) * (amax / 127)).view(9, 512).double()
    want = xq @ weight.double().T
    torch.testing.assert_close(ops.linear(x, *packed, None, None).double(), want, atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="columns of 256"):
        pack_int6_blocks(q[:, :128], scales[:, :8], d[:, :1])


def test_a_projection_of_two_formats_computes_both_parts_with_its_bias():
    """A fused projection whose rows come in two block formats (a GGUF's q and k in Q4_K, v in Q6_K: ``Linear.tail``)
    gives each part's product plus its share of the bias, and hands the fused block stack each part's weight, scales
    and bias."""
    from shared.engine.layers import _kernel_tensors
    from shared.engine.linear import Linear

    head, tail = random_int4k(32, 256, seed=1), random_int6(16, 256, seed=2)
    layer = Linear(256, 48, bias=True)
    layer.qweight, layer.qscale, layer.weight = *head, None
    layer.tail = Linear(256, 16, bias=False, device="meta")
    layer.tail.qweight, layer.tail.qscale, layer.tail.weight = *tail, None
    x = torch.randn(5, 256)
    got = layer(x)
    want = torch.cat([ops.linear(x, *head, None, None), ops.linear(x, *tail, None, None)], dim=-1) + layer.bias
    torch.testing.assert_close(got, want.detach(), atol=1e-5, rtol=1e-5)
    assert not layer.cuttable() and len(_kernel_tensors(layer)) == 6
    assert torch.equal(_kernel_tensors(layer)[5], layer.bias.detach()[32:])


def test_a_layer_of_some_rows_computes_what_the_whole_computes_for_them():
    """``Linear.rows``: a draft vocabulary's head. Its 4-bit blocks are the whole layer's own (a GGUF's blocks need not
    span their 16 steps, which packing them anew from floats would round again), and an int8 layer's rows keep their
    values and scales in every build's layout, so its outputs are the same bits; Q4_K blocks, whose scales a tile's
    rows share, refuse."""
    from shared.engine.linear import Linear
    from shared.engine.quant import pack_int4_blocks

    torch.manual_seed(4)
    layer, x = Linear(96, 160, bias=False), torch.randn(5, 96)
    q = torch.randint(2, 12, (160, 96), dtype=torch.uint8)  # blocks that do not span 0..15
    d, m = torch.rand(160, 3) * 0.01, torch.randn(160, 3) * 0.01
    layer.qweight, layer.qscale = pack_int4_blocks(q, d, m)
    layer.kernel_build, layer.weight = kernels.active(), None
    whole = layer(x)
    for ids in ([5, 17, 159, 0, 64, 33], [7], list(range(160))[::-1]):
        part = layer.rows(torch.tensor(ids), chunk=2)
        assert part.out_features % 16 == 0 and part.weights_kind() == "int4"
        assert torch.equal(part(x)[:, : len(ids)], whole[:, ids])
    floats = Linear(96, 40)
    assert torch.equal(floats.rows(torch.tensor([3, 1]))(x)[:, :2], floats(x)[:, [3, 1]])
    with pytest.raises(ValueError, match="rows 0..40 of a layer of 40"):
        floats.rows(torch.tensor([0, 40]))
    for tag in kernels.builds():  # (each build's own int8 layout)
        with kernels.use(tag):
            wide = Linear(96, 200, bias=True)
            wide.quantize("int8")
            whole = wide(x)
            for ids in ([5, 17, 199, 0, 64, 33], [7], list(range(200))[::-1]):
                part = wide.rows(torch.tensor(ids))
                assert part.weights_kind() == "int8" and part.out_features % 16 == 0
                assert torch.equal(part(x)[:, : len(ids)], whole[:, ids]), (tag, ids)
    blocks = Linear(256, 32, bias=False)
    blocks.qweight, blocks.qscale, blocks.weight = *random_int4k(32, 256, seed=3), None
    with pytest.raises(ValueError, match="int4 layer .* is not cut into rows"):
        blocks.rows(torch.tensor([0]))


def test_an_int8_head_is_cut_to_its_draft_vocabulary_as_it_is(tiny_target):
    """A model drafter whose head is served int8 (the 0.5B's Q8_0 head) drafts from its draft vocabulary too: the
    head's int8 rows and scales taken as they are, so the cut head's logits are the whole head's for those tokens."""
    import copy

    from client.drafters.model import draft_head

    head = copy.deepcopy(tiny_target.engine.lm_head)
    head.quantize("int8")

    class Drafting:  # what draft_head reads of a drafter's model: its tokenizer and head
        tokenizer = tiny_target.tokenizer
        engine = type("Engine", (), {"lm_head": head})

    ids, known, rows = draft_head(Drafting(), 16)
    assert len(ids) >= 16 and known == set(ids.tolist()) and rows.weights_kind() == "int8"
    hidden = torch.randn(3, head.in_features)
    assert torch.equal(rows(hidden)[:, : len(ids)], head(hidden)[:, ids])


@pytest.mark.parametrize("blocks", ["q4_1", "q4_k", "q6_k"])
def test_float_rows_are_the_values_a_low_bit_layer_computes_with(blocks):
    """``Linear.float_rows``: a drafter's head cut from a GGUF's low-bit head, as the float rows its blocks stand for
    (the native model converted from the same file has the same values), a few tiles unpacked at a time."""
    from shared.engine.linear import Linear
    from shared.engine.quant import dequantize_int4, dequantize_int4k, dequantize_int6

    packed = {"q4_1": lambda: pack_int4(torch.randn(160, 256)), "q4_k": lambda: random_int4k(160, 256),
              "q6_k": lambda: random_int6(160, 256)}[blocks]()  # fmt: skip
    unpack = {"q4_1": dequantize_int4, "q4_k": dequantize_int4k, "q6_k": dequantize_int6}[blocks]
    layer = Linear(256, 160, bias=False, device="meta")
    layer.weight, (layer.qweight, layer.qscale), layer.kernel_build = None, packed, kernels.active()
    whole = unpack(*packed)
    ids = torch.tensor([5, 17, 159, 0, 64, 33, 34])
    assert torch.equal(layer.float_rows(ids, chunk=2), whole[ids])
    with pytest.raises(ValueError, match="rows 0..160 of a layer of 160"):
        layer.float_rows(torch.tensor([0, 160]))
    floats = Linear(96, 40)
    assert torch.equal(floats.float_rows(torch.tensor([3, 1])), floats.weight.detach()[[3, 1]])
    floats.quantize("int8")
    with pytest.raises(ValueError, match="int8 layer .* is not unpacked"):
        floats.float_rows(torch.tensor([0]))


@pytest.mark.parametrize("pack", [pack_int8_active, pack_int4, pack_int4k, pack_int6])
@pytest.mark.parametrize("op", ["linear", "norm_linear", "mlp"])
def test_a_row_never_depends_on_the_rows_beside_it(op, pack):
    """The exactness guarantee: any subset of rows, in any count, gives bit-identical rows. The kernels tile up to
    32 rows and more rows differently (``gemm_blocks``): both are compared."""
    torch.manual_seed(1)
    E, Fh = (96, 160) if pack is pack_int8_active else (256, 2304)
    norm = torch.rand(E) + 0.5
    wq, sq = pack(torch.randn(3 * E, E) * 0.05)
    wgu, sgu = pack(torch.randn(2 * Fh, E) * 0.05)
    wd, sd = pack(torch.randn(E, Fh) * 0.05)
    calls = {
        "linear": lambda x: ops.linear(x, wq, sq, None, None),
        "norm_linear": lambda x: ops.norm_linear(x, norm, 1e-5, wq, sq, None),
        "mlp": lambda x: ops.mlp(x, norm, 1e-5, wgu, sgu, None, wd, sd, None),
    }
    x = torch.randn(40, E) * 3
    whole = calls[op](x)
    rng = random.Random(0)
    for count in (1, 2, 3, 5, 17, 33):
        rows = sorted(rng.sample(range(40), count))
        assert torch.equal(calls[op](x[rows]), whole[rows]), count


def test_mlp_and_norm_linear_compute_what_they_say():
    torch.manual_seed(2)
    E, Fh = 64, 96
    norm = torch.rand(E) + 0.5
    gate_up, down = torch.randn(2 * Fh, E) * 0.1, torch.randn(E, Fh) * 0.1
    x = torch.randn(4, E)
    h = F.rms_norm(x, (E,), norm, 1e-5)
    g, u = (h @ gate_up.T).chunk(2, dim=-1)
    want = x + (F.silu(g) * u) @ down.T
    got = ops.mlp(x, norm, 1e-5, *pack_int8_active(gate_up), None, *pack_int8_active(down), None)
    torch.testing.assert_close(got, want, atol=0.03, rtol=0.03)
    torch.testing.assert_close(ops.norm_linear(x, norm, 1e-5, *pack_int8_active(gate_up), None), h @ gate_up.T,
                               atol=0.03, rtol=0.03)  # fmt: skip


def reference_attention(qkv, cos, sin, k_past, v_past, mask, heads, kv_heads, d):
    """RoPE + causal/tree-masked grouped-query attention in fp64 torch."""
    T = qkv.shape[0]
    x = qkv.double().view(T, heads + 2 * kv_heads, d)
    rot = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    qk = x[:, : heads + kv_heads] * cos.double()[:, None] + rot[:, : heads + kv_heads] * sin.double()[:, None]
    x = torch.cat([qk, x[:, heads + kv_heads :]], dim=1)
    q, k, v = x[:, :heads], x[:, heads : heads + kv_heads], x[:, heads + kv_heads :]
    k = torch.cat([k_past.double(), k.transpose(0, 1)], dim=1).repeat_interleave(heads // kv_heads, 0)
    v = torch.cat([v_past.double(), v.transpose(0, 1)], dim=1).repeat_interleave(heads // kv_heads, 0)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask)
    return out.transpose(0, 1).reshape(T, heads * d).float()


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [16, 64])
def test_attention_is_exact_per_query_and_matches_a_reference(d, cache_dtype):
    """A tree of queries attends in one call; each query's output equals the same query alone (seeing the same
    keys), and both equal fp64 attention within rounding (fp16/bf16 caches: of the keys and values stored: a bf16
    model's own layers write bf16, as a MoA drafter's TLI over the target's KV does). d=64 is the vector path, 16
    the generic one."""
    torch.manual_seed(d)
    heads, kv_heads, past = 6, 2, 40
    parents = [-1, 0, 0, 1, 3, 2, -1]
    T = len(parents) + 1
    width = (heads + 2 * kv_heads) * d
    qkv = torch.randn(T, width)
    angles = torch.rand(T, d // 2) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    k_cache, v_cache = torch.zeros(kv_heads, 64, d, dtype=cache_dtype), torch.zeros(kv_heads, 64, d, dtype=cache_dtype)
    k_cache[:, :past], v_cache[:, :past] = torch.randn(kv_heads, past, d), torch.randn(kv_heads, past, d)
    mask = tree_mask(parents, past)[0]
    got = ops.attend(qkv, cos, sin, k_cache, v_cache, past, mask, heads, kv_heads, d**-0.5)
    want = reference_attention(qkv, cos, sin, k_cache[:, :past], v_cache[:, :past], mask, heads, kv_heads, d)
    # the new keys and values are stored in the cache's dtype
    tolerance = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 4e-2}[cache_dtype]
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)
    for node in range(-1, len(parents)):  # each path again, one token per call, at consecutive slots
        path = [0] + [1 + i for i in (path_to(parents, node) if node >= 0 else [])]
        k2, v2 = k_cache.clone(), v_cache.clone()
        for j, row in enumerate(path):
            alone = ops.attend(qkv[row : row + 1], cos[row : row + 1], sin[row : row + 1], k2, v2, past + j, None,
                               heads, kv_heads, d**-0.5)  # fmt: skip
        assert torch.equal(alone[0], got[path[-1]]), node


@pytest.mark.parametrize("past", [37, 40])
def test_a_query_attends_alike_wherever_it_sits_in_its_group(past):
    """A vector build sums a key's score four at a time (four keys of a query, or one key of four queries) and one at a
    time where fewer are left, each by the one fixed order; so query heads with the same query and key/value head
    get the same bits whatever their place in the group and whether the key count leaves a remainder."""
    if kernels.isa() == "portable":
        pytest.skip("the portable build has no vector path")
    torch.manual_seed(past)
    heads, kv_heads, d, T = 12, 2, 128, 3
    q, k, v = torch.randn(T, d), torch.randn(T, d), torch.randn(T, d)
    qkv = torch.cat([q.repeat(1, heads), k.repeat(1, kv_heads), v.repeat(1, kv_heads)], dim=1)
    cos, sin = torch.ones(T, d), torch.zeros(T, d)
    cached = torch.randn(2, 1, past, d, dtype=torch.float16).expand(2, kv_heads, past, d)
    k_cache, v_cache = (torch.zeros(kv_heads, past + T, d, dtype=torch.float16) for _ in range(2))
    k_cache[:, :past], v_cache[:, :past] = cached[0], cached[1]
    out = ops.attend(qkv, cos, sin, k_cache, v_cache, past, None, heads, kv_heads, d**-0.5).view(T, heads, d)
    for h in range(1, heads):
        assert torch.equal(out[:, h], out[:, 0]), h


def test_every_build_computes_the_same_bits():
    """The vector builds (avx512-vnni, avx-vnni, avx2: those this CPU runs) differ in speed only: linear layers (int8
    in each build's own layout, int4 of Q4_1 and of Q4_K blocks, int6), the fused MLP and attention over fp32, fp16
    and bf16 caches give identical bits, so a client on one CPU and a server on another serve the same target. (The
    portable build's norms and exp sum in another order: a target of its own, for CPUs without AVX2.)"""
    builds = [b for b in kernels.builds() if b != "portable"]
    if len(builds) < 2:
        pytest.skip(f"one kernel build here ({builds}): nothing to compare")
    torch.manual_seed(5)
    E, Fh, T = 96, 160, 17
    w, x, bias, res = torch.randn(Fh, E) * 0.05, torch.randn(T, E), torch.randn(Fh), torch.randn(T, Fh)
    gate_up, down, norm = torch.randn(2 * Fh, E) * 0.05, torch.randn(E, Fh) * 0.05, torch.rand(E) + 0.5
    results = {}
    for tag in builds:
        o = kernels.ops(tag)
        i8 = lambda t, layout=o.int8_layout(): pack_int8(t, layout)  # noqa: E731
        got = [o.linear(x, *i8(w), bias, res), o.linear(x, *pack_int4(w), bias, res),
               o.linear(torch.randn(T, 512, generator=torch.Generator().manual_seed(7)), *random_int6(Fh, 512), bias,
                        res),
               o.linear(torch.randn(T, 512, generator=torch.Generator().manual_seed(7)), *random_int4k(Fh, 512), bias,
                        res),
               *(o.linear(torch.randn(m, 768, generator=torch.Generator().manual_seed(m)), *pack, None, None)
                 for m in (1, 3, 40) for pack in (random_int4k(48, 768), random_int6(48, 768))),  # every tiling
               o.mlp(x, norm, 1e-5, *i8(gate_up), None, *i8(down), None),
               o.mlp(x, norm, 1e-5, *pack_int4(gate_up), None, *pack_int4(down), None)]  # fmt: skip
        for cache_dtype in (torch.float32, torch.float16, torch.bfloat16):
            torch.manual_seed(6)
            qkv, cos, sin = torch.randn(5, 8 * 64), torch.rand(5, 64), torch.rand(5, 64)
            k, v = (torch.randn(2, 32, 64).to(cache_dtype) for _ in range(2))
            got.append(o.attend(qkv, cos, sin, k, v, 20, tree_mask([-1, 0, 0, 1], 20)[0], 4, 2, 0.125))
            got += [k, v]  # the keys and values it wrote
        results[tag] = got
    first = builds[0]
    for tag in builds[1:]:
        for i, (a, b) in enumerate(zip(results[first], results[tag], strict=True)):
            assert torch.equal(a, b), (first, tag, i)


def tdpbssd(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """An AMX tile multiply as Intel's manual states it: C[m][n] = sum over the 4-byte groups j of B's rows and i < 4
    of A[m][4j + i] * B[j][4n + i], signed bytes, int32 sums."""
    groups = b.shape[0]
    return np.einsum("mji,jni->mn", a.astype(np.int32).reshape(a.shape[0], groups, 4),
                     b.astype(np.int32).reshape(groups, -1, 4))  # fmt: skip


def test_cols16_int8_weights_are_an_amx_tile_operand_as_they_are():
    """The amx build multiplies cols16 weights as a tile multiply's second operand with no repacking: 16 of a tile's
    K groups (64 bytes each: 16 columns x 4 values) are one B tile, the activations' 64 values the A tile. Checked
    here on any CPU with the instruction's own definition: the tiles' sums over K are the exact integer product."""
    gen = torch.Generator().manual_seed(3)
    n, k, m = 40, 96 + 32, 5  # a K that ends in a half step of 32 values, as the kernel's last tile step
    q, _ = pack_int8(torch.randn(n, k, generator=gen), "cols16")
    x = torch.randint(-127, 128, (m, q.shape[1] * 4), generator=gen, dtype=torch.int8).numpy()
    rows = q.permute(0, 2, 1, 3).reshape(q.shape[0] * 16, -1)  # back to [out padded to 16, K] row-major
    want = x.astype(np.int64) @ rows.numpy().astype(np.int64).T
    for t in range(q.shape[0]):
        tile = q[t].reshape(-1, 64).numpy()  # K groups, each 16 columns' 4 values
        got = np.zeros((m, 16), dtype=np.int32)
        for g in range(0, tile.shape[0], 16):  # a step of 64 values of K (16 groups), or the last of 32 (8)
            got += tdpbssd(x[:, 4 * g : 4 * (g + tile[g : g + 16].shape[0])], tile[g : g + 16])
        assert np.array_equal(got, want[:, 16 * t : 16 * (t + 1)]), t


@pytest.mark.parametrize("k", [64, 96, 1536])
def test_the_amx_build_gives_the_vnni_builds_bits_at_every_row_count(k):
    """The amx build takes int8 sums from AMX tiles from a few rows on (one or two tiles of 16 rows a pass) and from
    the VNNI code below that: every row count gives the avx512-vnni build's bits, bias and residual included."""
    if "amx" not in kernels.builds():
        pytest.skip(f"no amx build here: {kernels.load('amx')}")
    amx, vnni = kernels.ops("amx"), kernels.ops("avx512-vnni")
    gen = torch.Generator().manual_seed(k)
    w = torch.randn(72, k, generator=gen) * 0.05
    q, scale = pack_int8(w, "cols16")
    for m in (1, 3, 4, 5, 16, 17, 32, 33, 70):
        x, res = torch.randn(m, k, generator=gen), torch.randn(m, 72, generator=gen)
        bias = torch.randn(72, generator=gen)
        got = amx.linear(x, q, scale, bias, res)
        assert torch.equal(got, vnni.linear(x, q, scale, bias, res)), m
        assert torch.equal(amx.linear(x, q, scale, None, None), int8_reference(x, w)), m


@pytest.mark.parametrize("blocks", ["q4_1", "q4_k", "q6_k"])
def test_the_amx_build_gives_the_vnni_builds_bits_on_block_formats(blocks):
    """The amx build runs the 4-bit formats' forwards of 12-64 rows on AMX tiles in passes of up to 32 rows (a
    block's sums through one or two row tiles, the second as short as the rows need; the float steps the VNNI
    code's), and Q6_K's passes of 16, the rest of the rows on the VNNI code: every row count, bias and residual
    included, gives the avx512-vnni build's bits."""
    if "amx" not in kernels.builds():
        pytest.skip(f"no amx build here: {kernels.load('amx')}")
    amx, vnni = kernels.ops("amx"), kernels.ops("avx512-vnni")
    gen = torch.Generator().manual_seed(3)
    packed = {"q4_1": lambda: pack_int4(torch.randn(48, 768, generator=gen)), "q4_k": lambda: random_int4k(48, 768),
              "q6_k": lambda: random_int6(48, 768)}[blocks]()  # fmt: skip
    for m in (1, 8, 9, 12, 15, 16, 17, 18, 20, 24, 25, 31, 32, 33, 36, 41, 48, 64, 70):
        x, res = torch.randn(m, 768, generator=gen), torch.randn(m, 48, generator=gen)
        bias = torch.randn(48, generator=gen)
        assert torch.equal(amx.linear(x, *packed, bias, res), vnni.linear(x, *packed, bias, res)), m


def test_bad_arguments_are_named():
    q, scale = pack_int8_active(torch.randn(8, 40))
    with pytest.raises(RuntimeError, match="weight rows hold 64 values; input has K = 70, expected 96"):
        ops.linear(torch.randn(2, 70), q, scale, None, None)
    with pytest.raises(RuntimeError, match="expected fp32 CPU rows"):
        ops.linear(torch.randn(2, 40, dtype=torch.float64), q, scale, None, None)
    with pytest.raises(RuntimeError, match="attend mask: expected"):
        ops.attend(torch.randn(2, 3 * 16), torch.ones(2, 16), torch.zeros(2, 16), torch.zeros(1, 8, 16),
                   torch.zeros(1, 8, 16), 0, torch.ones(3, 3, dtype=torch.bool), 1, 1, 0.25)  # fmt: skip


@pytest.mark.parametrize("sign", [1, -1])
def test_block_sums_at_their_largest_are_exact_in_every_build(sign):
    """Blocks at their largest sums (every value at its top, every activation ±127): in the avx2 build 16 products of
    a 4-bit block (30,480) and 4 of a 6-bit one (32,004) share a 16-bit lane before they widen, just under 2^15.
    Every build gives the float64 product of the same values, within float rounding (a lane that wrapped would be
    off by 2^16 steps)."""
    n, k, m = 16, 512, 3
    ones = torch.ones(n, k // 32)
    d = torch.full((n, k // 256), 0.01).half()
    four = pack_int4k_blocks(torch.full((n, k), 15, dtype=torch.uint8), ones * 63, ones * 0, d, d * 0)
    top6 = torch.full((n, k // 16), 127, dtype=torch.int8)
    six = pack_int6_blocks(torch.full((n, k), 63, dtype=torch.uint8), top6, d)
    x = torch.full((m, k), float(sign))
    for packed, unpack, top in ((four, dequantize_int4k, 15 * 63), (six, dequantize_int6, 31 * 127)):
        want = x.double() @ unpack(*packed).double().T
        assert want[0, 0] == pytest.approx(sign * k * top * float(d[0, 0]))  # the values are what the test means
        for tag in kernels.builds():
            got = kernels.ops(tag).linear(x, *packed, None, None)
            assert torch.allclose(got.double(), want, rtol=1e-5), (tag, top, got[0, 0].item(), want[0, 0].item())


def test_every_build_measures_its_int8_peak():
    """``kernels.int8_peak`` times each build's multiply instruction alone: a finite rate of over one multiply-add
    every 10 ns (the portable loop's is ~5 G/s), and a bad step count is refused with the value named."""
    for tag in kernels.builds():
        peak = kernels.int8_peak(tag, seconds=0.01)
        assert math.isfinite(peak) and peak > 1e8, (tag, peak)
    with pytest.raises(RuntimeError, match="steps must be positive, got 0"):
        ops.int8_peak(0)


def test_the_memory_read_rate_is_measured_and_bad_sizes_are_named():
    """``kernels.read_peak`` streams a buffer on torch's threads: a finite rate of over 100 MB/s (any memory) and
    under 10 TB/s (none yet); a buffer under 1 MiB, which the caches would hold, is refused with its size named."""
    rate = kernels.read_peak(megabytes=8, passes=1)
    assert math.isfinite(rate) and 1e8 < rate < 1e13, rate
    with pytest.raises(RuntimeError, match="at least 1 MiB read at least once, got 4096 bytes 1 times"):
        ops.read_rate(torch.empty(4096, dtype=torch.uint8), 1)
    with pytest.raises(RuntimeError, match="got 1048576 bytes 0 times"):
        ops.read_rate(torch.empty(1 << 20, dtype=torch.uint8), 0)


def test_the_engine_bench_reads_plain_decoding_against_the_memory(tiny_target):
    """bench.engine: a token's weight bytes are every linear layer's, the head's once; plain decoding's GB/s is the
    tokens a second times those bytes, read against the rate measured before our decoding, and both rates named."""
    from bench.common import stream_bytes
    from bench.engine import read_lines
    from shared.engine.linear import Linear

    linears = [m for m in tiny_target.engine.modules() if isinstance(m, Linear)]
    assert stream_bytes(tiny_target) == sum(m.weight.nbytes for m in linears)  # fp32, untied, no biases
    result = {"environment": {"threads": 2},
              "memory": {"read_gb_per_s": {"decode": 36.0, "after decode": 40.0, "llama.cpp": 50.0},
                         "gb_per_token": {"fp32+lowbit": 1.0}},
              "decode": {"none fp32+lowbit": {"dtype": "fp32+lowbit", "median_decode_tokens_per_s": 30.0},
                         "prompt-lookup fp32+lowbit": {"dtype": "fp32+lowbit", "median_decode_tokens_per_s": 90.0}}}
    lines = read_lines(result)  # fmt: skip
    assert "GB/s: 36.0 before decode, 40.0 after decode, 50.0 before llama.cpp" in lines[0]
    assert lines[1] == ("* fp32+lowbit: 1.000 GB a token, 30.0 GB/s after the prefill: 75% of the faster read around "
                        "it, which allows 40.0 tok/s")
    assert lines[-1] == ("\nThe memory read 1.25× as fast around llama.cpp as around the other: the two decoding "
                         "rates were not measured on the same memory.")
    result["memory"]["read_gb_per_s"]["llama.cpp"] = 42.0
    assert len(read_lines(result)) == 2  # within 15 %: no warning
    result["decode"]["none fp32+lowbit"]["median_decode_tokens_per_s"] = 45.0
    assert read_lines(result)[1].endswith("(over 100 %: the memory ran faster while it decoded than when read)")
    assert read_lines({"memory": {"read_gb_per_s": {}}}) == read_lines({}) == []


def test_the_engine_bench_reads_a_one_token_forward_against_the_memory():
    """bench.engine: a one-token forward's weights over its ms, against the read rate measured before the table."""
    from bench.engine import forward_read_lines

    result = {"settings": {"sizes": [1, 17]},
              "memory": {"read_gb_per_s": {"forward": 40.0}, "gb_per_token": {"fp32+lowbit": 1.0, "fp32": None}},
              "forward": [{"engine": "splitspec tree", "dtype": "fp32+lowbit", "n": 1, "ms": 32.0},
                          {"engine": "splitspec tree", "dtype": "fp32+lowbit", "n": 17, "ms": 96.0},
                          {"engine": "splitspec chain", "dtype": "fp32+lowbit", "n": 1, "ms": 31.0}]}  # fmt: skip
    assert forward_read_lines(result) == ["\nOne token's forward reads its weights at fp32+lowbit 31.2 GB/s (78%) of "
                                          "the 40.0 GB/s the memory read before the table (`kernels.read_peak`)."]
    assert forward_read_lines({**result, "settings": {"sizes": [5, 17]}}) == []
    assert forward_read_lines({**result, "memory": {}}) == []


def test_plain_decoding_beside_llama_cpp_reads_each_round_against_the_memory():
    """bench.single's side-by-side rounds: each engine's pace and its share of the ceiling the round's read rate sets
    (read rate ÷ a token's bytes); no table where the rate was not measured."""
    from bench.single import llama_lines, side_by_side_table

    side = {"llama_tokens_per_s": [30.0, 40.0], "ours_tokens_per_s": [33.0, 36.0], "read_gb_per_s": [40.0, 50.0],
            "gb_per_token": 1.0, "median_ratio": 1.0}  # fmt: skip
    table = side_by_side_table(side)
    assert table[-2:] == ["| 1 | 40.0 | 40.0 | 30.00 (75%) | 33.00 (82%) | 1.100× |",
                          "| 2 | 50.0 | 50.0 | 40.00 (80%) | 36.00 (72%) | 0.900× |"]  # fmt: skip
    text = llama_lines({"plain_tokens_per_s": 35.0, "plain_side_by_side": side})
    assert "**1.000× llama.cpp**" in text and "\n\n| round | memory read GB/s |" in text
    assert side_by_side_table({**side, "read_gb_per_s": [None, None]}) == []


def test_the_engine_bench_reads_int8_rates_against_the_peak():
    """bench.engine's table: n × a token's multiply-adds over the forward's ms, and the share of the peak."""
    from bench.engine import int8_table

    rates = {"fp32+int4": {"build": "avx2", "g_macs_per_token": 1.31, "peak_g_per_s": 300.0,
                           "g_per_s": {"1": 30.0, "17": 240.0}}}  # fmt: skip
    table = int8_table(rates, [1, 5, 17])
    assert table[-1] == "| fp32+int4 | avx2 | 1.31 | 30 (10%) | – | 240 (80%) | 300 |"
    assert int8_table({}, [1]) == []
