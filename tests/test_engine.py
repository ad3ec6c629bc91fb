"""The engine (shared/engine/decoder.py) against transformers, and against itself across forward shapes."""

from __future__ import annotations

import random

import pytest
import torch

from client.drafters import NoDrafter, PromptLookup
from client.loop.decode import Settings, generate
from client.verifiers import LocalVerifier
from shared.engine.models import load_target
from shared.errors import SplitspecError
from shared.tree import DraftTree, causal_from, path_to, tree_mask, tree_positions


def test_prefill_and_steps_match_transformers(tiny_target):
    """Logits of a prefill and of single cached steps equal transformers' within fp32 tolerance."""
    model = tiny_target.reference_model()
    ids = [5, 17, 42, 8, 99, 3, 61, 7, 12]
    engine = tiny_target.engine
    cache = engine.new_cache(64)
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0]
        got = engine.logits(engine(torch.tensor([ids[:5]]), torch.arange(5)[None], causal_from(0, 5), cache, 0)[0])
        steps = [engine.logits(engine(torch.tensor([[t]]), torch.tensor([[p]]), None, cache, p)[0, 0])
                 for p, t in enumerate(ids[5:], start=5)]  # fmt: skip
    torch.testing.assert_close(got, want[:5], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.stack(steps), want[5:], atol=1e-4, rtol=1e-4)


def test_qkv_and_gate_up_are_fused_from_a_checkpoint(tiny_target):
    """A Llama checkpoint's separate projections load into the fused matrices, in order."""
    ref = tiny_target.reference_model().model.layers[0]
    layer = tiny_target.engine.layers[0]
    q, k, v = ref.self_attn.q_proj.weight, ref.self_attn.k_proj.weight, ref.self_attn.v_proj.weight
    assert torch.equal(layer.self_attn.qkv.weight, torch.cat([q, k, v]))
    assert torch.equal(layer.mlp.gate_up.weight, torch.cat([ref.mlp.gate_proj.weight, ref.mlp.up_proj.weight]))


EXACT = [("bfloat16", "native"), ("float32", "int8"), ("float32", "int4")]


@pytest.fixture(scope="module", params=EXACT, ids=["bf16", "int8", "int4"])
def tiny_exact(tiny_model_dir, request):
    """The tiny target served each way whose rows must not depend on the forward's shape (the low-bit ones on
    splitspec's CPU kernels)."""
    from shared.engine import kernels

    dtype, weights = request.param
    if weights != "native" and not kernels.available():
        pytest.skip(f"no CPU kernels: {kernels.unavailable_reason()}")
    return load_target(str(tiny_model_dir), dtype=dtype, weights=weights)


@pytest.mark.parametrize("seed", [0, 1])
def test_tree_states_are_bit_identical_to_sequential_steps(tiny_exact, seed):
    """Every node of a tree verified in one forward gets exactly the hidden state and logits its path gets one
    token at a time, in bf16 and on the int8 and int4 kernels: the engine's rows do not depend on how many tokens
    share a forward."""
    rng = random.Random(seed)
    engine, vocab = tiny_exact.engine, tiny_exact.vocab_size
    if tiny_exact.weights != "native":
        assert engine.layers[0]._fused(torch.zeros(1, 1, 64), (0, 0), [])  # the kernels run the blocks
    prompt = [rng.randrange(vocab) for _ in range(20)]
    tree = DraftTree()
    for i in range(12):
        tree.add(rng.randrange(vocab), rng.randrange(-1, i))
    root = rng.randrange(vocab)
    with torch.no_grad():
        cache = engine.new_cache(64)
        n = len(prompt)
        engine(torch.tensor([prompt]), torch.arange(n)[None], causal_from(0, n), cache, 0)
        ids = torch.tensor([[root, *tree.tokens]])
        pos = torch.tensor([tree_positions(tree.parents, n)])
        batched = engine(ids, pos, tree_mask(tree.parents, n), cache, n)[0]
        logits = engine.logits(batched)
        for node in range(-1, len(tree)):
            path = [root] + [tree.tokens[i] for i in (path_to(tree.parents, node) if node >= 0 else [])]
            for j, token in enumerate(path):  # one token per forward, overwriting the tree's slots
                alone = engine(torch.tensor([[token]]), torch.tensor([[n + j]]), None, cache, n + j)[0, 0]
            assert torch.equal(alone, batched[node + 1]), node
            assert torch.equal(engine.logits(alone[None])[0], logits[node + 1]), node


def test_one_forward_of_many_sequences_equals_each_alone_block_by_block(tiny_exact):
    """``forward_many`` (on the kernels: every block in one call) gives two sequences, one a tree, exactly the
    states each gets alone through ``Transformer.forward`` (block by block)."""
    from shared.engine.decoder import Part

    engine, rng = tiny_exact.engine, random.Random(3)
    if tiny_exact.weights != "native":
        assert engine.kernel_blocks() is not None and engine.kernel_blocks().size() == len(engine.layers)
    a, b = (
        [rng.randrange(tiny_exact.vocab_size) for _ in range(9)],
        [rng.randrange(tiny_exact.vocab_size) for _ in range(5)],
    )
    parents = [-1, 0, 0, 1]
    with torch.no_grad():
        alone = []
        for ids, mask, pos in (
            (a, causal_from(0, 9), list(range(9))),
            (b, tree_mask(parents, 0), tree_positions(parents, 0)),
        ):
            cache = engine.new_cache(16)
            alone.append(engine(torch.tensor([ids]), torch.tensor([pos]), mask, cache, 0)[0])
        parts = [
            Part(a, list(range(9)), causal_from(0, 9), engine.new_cache(16), 0),
            Part(b, tree_positions(parents, 0), tree_mask(parents, 0), engine.new_cache(16), 0),
        ]
        together = engine.forward_many(parts)
    assert torch.equal(together[0], alone[0]) and torch.equal(together[1], alone[1])


def test_speculative_output_equals_plain_decoding(tiny_exact):
    prompt = [5, 9, 14, 5, 9, 21, 33, 5, 9, 14]
    plain = generate(LocalVerifier(tiny_exact), NoDrafter(), prompt, 40)
    for drafter in (PromptLookup(), PromptLookup(branches=3, num_tokens=6)):
        got = generate(LocalVerifier(tiny_exact), drafter, prompt, 40)
        assert got.token_ids == plain.token_ids


def test_rollback_is_setting_the_length(tiny_target):
    """truncate moves the length back; the next step overwrites the stale slots and matches a fresh session."""
    session = tiny_target.session()
    session.prefill([5, 17, 42, 8])
    for _ in range(5):
        session.verify(DraftTree())
    session.truncate(6)
    assert session.cached_len == 5
    after = session.verify(DraftTree()).new_tokens
    fresh = tiny_target.session()
    fresh.prefill(session.tokens[:5])
    assert fresh.tokens[-1] == session.tokens[5]
    assert fresh.verify(DraftTree()).new_tokens == after


def test_the_lm_head_runs_once_when_the_walk_takes_the_likeliest_path(tiny_target, monkeypatch):
    """A verified tree's head rows: the root, the nodes with children and the leaf of the first children (the path a
    confident target takes) in one matmul; another leaf's row only when the walk ends on it. The tokens are plain
    decoding's either way."""
    prompt = [5, 17, 42, 8]
    plain = tiny_target.session()
    plain.prefill(prompt)
    for _ in range(4):
        plain.verify(DraftTree())
    after = plain.tokens[len(prompt) + 1 :]  # past the root, the token prefill picked
    a, b, c = after[:3]
    wrong = (a + 1) % tiny_target.vocab_size
    calls = []
    engine = tiny_target.engine
    logits = engine.logits
    monkeypatch.setattr(engine, "logits", lambda hidden: calls.append(hidden.shape[0]) or logits(hidden))
    cases = [  # tree, head rows per matmul
        (DraftTree([a, wrong, b, c], [-1, -1, 0, 2]), [4]),  # root, a, b and the leaf c; the leaf "wrong" never
        (DraftTree([wrong, a], [-1, -1]), [2, 1]),  # the walk ends on the second child, a leaf
    ]
    for tree, rows in cases:
        session = tiny_target.session()
        session.prefill(prompt)
        calls.clear()
        verdict = session.verify(tree)
        assert calls == rows
        assert verdict.new_tokens == after[: len(verdict.new_tokens)]


def test_unsupported_models_are_refused_clearly(tmp_path):
    import json

    from shared.engine.decoder import ModelConfig

    class Cfg:
        model_type = "gpt2"

    with pytest.raises(ValueError, match="gpt2"):
        ModelConfig.from_hf(Cfg())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(SplitspecError, match="could not load model"):
        load_target(str(tmp_path))


def test_int8_weights_are_a_target_lossless_relative_to_itself(tiny_model_dir):
    """int8 weights on a bf16 model: drafted output equals its own plain decoding."""
    int8 = load_target(str(tiny_model_dir), dtype="bfloat16", weights="int8")
    assert int8.engine.layers[0].mlp.down_proj.qweight.dtype == torch.int8
    assert int8.engine.layers[0].mlp.down_proj.weight is None
    prompt = [5, 9, 14, 5, 9, 21, 33, 5, 9, 14]
    plain = generate(LocalVerifier(int8), NoDrafter(), prompt, 40)
    for drafter in (PromptLookup(), PromptLookup(branches=3, num_tokens=6)):
        assert generate(LocalVerifier(int8), drafter, prompt, 40).token_ids == plain.token_ids
    with pytest.raises(SplitspecError, match="weights"):
        load_target(str(tiny_model_dir), weights="int3")


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_low_bit_drafter_weights_leave_the_target_untouched(tiny_target, kind):
    """A trained drafter quantized to int8 or int4: its own projections and draft head are low-bit, the target's
    blocks it shares for TLI are not, and greedy output still equals plain decoding."""
    from client.drafters import quantize_drafter
    from client.drafters.moa import MoA, MoAConfig, MoADrafter
    from client.drafters.target_parts import TargetParts
    from shared.engine import kernels

    if not kernels.available():
        pytest.skip(f"no CPU kernels: {kernels.unavailable_reason()}")
    torch.manual_seed(0)
    parts = TargetParts(tiny_target, 1)
    model = MoA(MoAConfig.for_target(parts, 1), parts).eval()
    quantize_drafter(model, kind)
    assert model.sa.mlp.down_proj.weights_kind() == kind and model.parts.head is not None
    assert all(m.qweight is None for m in tiny_target.engine.modules() if hasattr(m, "qweight"))
    prompt = [5, 9, 14, 5, 9, 21, 33]
    plain = generate(LocalVerifier(tiny_target), NoDrafter(), prompt, 24)
    got = generate(
        LocalVerifier(tiny_target), MoADrafter(model, width=3, depth=3), prompt, 24,
        Settings(max_tree_nodes=8),
    )  # fmt: skip
    assert got.token_ids == plain.token_ids


def test_the_gpu_plan_for_exact_bf16_keeps_rows_exact_here_too(tiny_model_dir):
    """Exact bf16 on a GPU (``decoder.exact_rows``: projections in fixed blocks of 64 rows, norms in fp64, attention
    over an fp64 cache, no CPU kernels) run here: a tree's nodes get exactly the states their paths get a token at a
    time, and one forward of two sequences what each gets alone. (What only a GPU can check, cuBLAS giving one
    answer per shape, ``make bench-gpu`` does.)"""
    from shared.engine.decoder import Part, exact_rows
    from shared.engine.linear import CUDA_ROWS

    engine = load_target(str(tiny_model_dir), dtype="bfloat16").engine
    exact_rows(engine)  # the GPU's path here too: torch's attention over fp64, not the kernels'
    assert engine.lm_head.exact_rows == CUDA_ROWS and engine.norm.exact and engine.new_cache(4).k.dtype == torch.float64
    rng, vocab = random.Random(5), engine.cfg.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(11)]
    tree = DraftTree()
    for i in range(9):
        tree.add(rng.randrange(vocab), rng.randrange(-1, i))
    n = len(prompt)
    with torch.no_grad():
        cache = engine.new_cache(32)
        engine(torch.tensor([prompt]), torch.arange(n)[None], causal_from(0, n), cache, 0)
        ids = [prompt[-1], *tree.tokens]
        batched = engine(torch.tensor([ids]), torch.tensor([tree_positions(tree.parents, n)]),
                         tree_mask(tree.parents, n), cache, n)[0]  # fmt: skip
        for node in range(-1, len(tree)):
            path = [prompt[-1]] + [tree.tokens[i] for i in (path_to(tree.parents, node) if node >= 0 else [])]
            for j, token in enumerate(path):
                alone = engine(torch.tensor([[token]]), torch.tensor([[n + j]]), None, cache, n + j)[0, 0]
            assert torch.equal(alone, batched[node + 1]), node
        parts = [
            Part(prompt, list(range(n)), causal_from(0, n), engine.new_cache(16), 0),
            Part(ids, tree_positions(tree.parents, 0), tree_mask(tree.parents, 0), engine.new_cache(16), 0),
        ]
        together = engine.forward_many(parts)
        for part, got in zip(parts, together, strict=True):
            alone = engine(torch.tensor([part.ids]), torch.tensor([part.positions]), part.mask, engine.new_cache(16), 0)
            assert torch.equal(got, alone[0])


def mixed_parts(engine, rng: random.Random, count: int) -> list:
    """``count`` sequences of every kind a batch holds, each with a cache already filled: a prompt's next piece
    (causal), a tree after a prefix, one token, a tree from slot 0."""
    from shared.engine.decoder import Part

    vocab, parts, dev = engine.cfg.vocab_size, [], engine.device
    for j in range(count):
        cache, prefix = engine.new_cache(64), [rng.randrange(vocab) for _ in range(3 + 2 * j)]
        at = 0 if j % 4 == 3 else len(prefix)
        if at:
            engine.forward_many([Part(prefix, list(range(at)), causal_from(0, at, dev), cache, 0)])
        tree = DraftTree()
        for i in range(1 + j % 5):
            tree.add(rng.randrange(vocab), rng.randrange(-1, i))
        ids = [rng.randrange(vocab), *tree.tokens]
        if j % 4 == 0:
            parts.append(Part(ids, list(range(at, at + len(ids))), causal_from(at, len(ids), dev), cache, at))
        elif j % 4 == 2:
            parts.append(Part(ids[:1], [at], None, cache, at))
        else:
            parts.append(Part(ids, tree_positions(tree.parents, at), tree_mask(tree.parents, at, dev), cache, at))
    return parts


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the GPU's own run of its plan"))])  # fmt: skip
def test_many_sequences_attend_as_padded_groups_with_one_at_a_times_bits(tiny_model_dir, device):
    """The exact bf16 recipe (fp64 caches) attends a forward's sequences as padded groups (``shared.engine.padded``):
    every sequence's states and its cache's entries are one-at-a-time attention's, bit for bit, in one group or in
    several (a budget that fits two or three sequences)."""
    from shared.engine.decoder import exact_rows

    engine = load_target(str(tiny_model_dir), device=device, dtype="bfloat16").engine
    exact_rows(engine)
    runs = {}
    with torch.no_grad():
        for budget in (0, 1 << 30, 20_000):
            engine.padded_bytes = budget
            parts = mixed_parts(engine, random.Random(11), 7)
            runs[budget] = ([h.clone() for h in engine.forward_many(parts)],
                            [(p.cache.k[..., : p.at + len(p.ids), :], p.cache.v[..., : p.at + len(p.ids), :])
                             for p in parts])  # fmt: skip
    engine.padded_bytes = 1 << 30
    alone = runs.pop(0)
    for budget, (states, caches) in runs.items():
        for j, (a, b) in enumerate(zip(alone[0], states, strict=True)):
            assert torch.equal(a, b), (budget, j)
        for j, (a, b) in enumerate(zip(alone[1], caches, strict=True)):
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (budget, j)


def test_padded_attention_launches_per_sequence_a_forward_not_a_layer(tiny_model_dir):
    """What a GPU pays for is launches: one sequence at a time, a forward's kernels grow by a few per sequence per
    layer; padded, by a few per sequence (its mask), however many layers. Counted here as the non-view ops torch
    dispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from shared.engine.decoder import exact_rows

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += not func.is_view
            return func(*args, **(kwargs or {}))

    engine = load_target(str(tiny_model_dir), dtype="bfloat16").engine
    exact_rows(engine)
    layers, growth = engine.cfg.num_layers, {}
    with torch.no_grad():
        for budget in (0, 1 << 30):
            engine.padded_bytes = budget
            ops = {}
            for count in (2, 8):
                parts = mixed_parts(engine, random.Random(3), count)
                with Count() as counted:
                    engine.forward_many(parts)
                ops[count] = counted.ops
            growth[budget] = (ops[8] - ops[2]) / 6
    engine.padded_bytes = 1 << 30
    assert growth[0] >= 3 * layers  # one at a time: a write and an attention per sequence per layer
    assert growth[1 << 30] <= 4, growth  # padded: the sequence's mask and its rows, once a forward


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="captured graphs need CUDA"))])  # fmt: skip
def test_forwards_on_graph_buckets_give_the_eager_bits(tiny_model_dir, device):
    """The GPU's exact recipe with its forwards on graphs (``shared.engine.graphs``; on a CPU the same static-buffer
    program uncaptured): rows padded to their bucket, attention between the steps, and every forward's states equal
    eager's bit for bit: a prefill, a tree, two sequences together, single steps, and a forward past the largest
    bucket (eager)."""
    from shared.engine.decoder import Part, exact_rows
    from shared.engine.graphs import use_graphs

    engine = load_target(str(tiny_model_dir), device=device, dtype="bfloat16").engine
    exact_rows(engine, 16)
    dev = engine.device
    rng, vocab = random.Random(7), engine.cfg.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(11)]
    tree = DraftTree()
    for i in range(6):
        tree.add(rng.randrange(vocab), rng.randrange(-1, i))
    n, ids = len(prompt), [prompt[-1], *tree.tokens]
    steps = [
        lambda c: [Part(prompt, list(range(n)), causal_from(0, n, dev), c[0], 0)],
        lambda c: [Part(ids, tree_positions(tree.parents, n), tree_mask(tree.parents, n, dev), c[0], n)],
        lambda c: [Part([ids[1]], [n + 1], None, c[0], n + 1),
                   Part(ids, tree_positions(tree.parents, 0), tree_mask(tree.parents, 0, dev), c[1], 0)],  # fmt: skip
        lambda c: [Part([ids[2]], [n + 2], None, c[0], n + 2)],
        lambda c: [Part(prompt * 2, list(range(7, 2 * n + 7)), causal_from(7, 2 * n, dev), c[1], 7)],
    ]
    runs = {}
    with torch.inference_mode():
        for graphs in (False, True):
            engine.graphs = None
            if graphs:
                used = use_graphs(engine, (1, 4, 16))  # captured on CUDA
            caches = [engine.new_cache(64), engine.new_cache(64)]
            runs[graphs] = [engine.forward_many(step(caches)) for step in steps]
    engine.graphs = None
    assert sorted(used.captured) == [1, 16]  # 11, 7 and 1 + 7 rows in 16, 1 in 1; 22 past the largest bucket
    assert sorted(used.warm().captured) == [1, 4, 16]
    for eager, graphed in zip(runs[False], runs[True], strict=True):
        for a, b in zip(eager, graphed, strict=True):
            assert torch.equal(a, b)


def test_a_bf16_linear_rows_do_not_depend_on_how_many_share_the_call():
    """bf16 GEMMs on a CPU pick kernels by shape (here, an Intel CPU with AMX: rows of a [1536 x 576] product differ
    between 16, 32 and 64 rows; a Zen 5: a single row with K = 1536): ``Linear`` multiplies bf16 rows in fixed
    blocks, so each row comes out the same alone, in a tree or in a prefill, wherever it sits."""
    from shared.engine.linear import Linear

    torch.manual_seed(0)
    for k, n in ((576, 1536), (1536, 576), (576, 4096)):
        layer = Linear(k, n, bias=False).to(torch.bfloat16)
        x = torch.randn(80, k, dtype=torch.bfloat16)
        whole = layer(x)
        for m, at in ((1, 0), (1, 7), (2, 3), (5, 0), (16, 1), (17, 0), (32, 5), (33, 2), (64, 16)):
            assert torch.equal(layer(x[at : at + m]), whole[at : at + m]), (k, n, m, at)
        assert torch.equal(layer(x[None, 3:9])[0], whole[3:9])  # [B, T, K] as the engine passes it
