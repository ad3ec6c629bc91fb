"""The target engine: a Llama-family decoder in plain PyTorch, over the weights of a Hugging Face folder.

What SmolLM2, Llama-2/3 and Qwen2-style configs describe: grouped-query attention, RoPE with its
scaling, SwiGLU, RMSNorm, a tied or untied head, optional QKV biases. No transformers module runs
on the hot path (transformers only parses the config and computes the rope frequencies once):
one forward is embeddings -> ``shared.engine.layers.Block`` x L -> norm, with projections fused and a
preallocated KV cache written by position. The same blocks are the drafters' building blocks, so a MoA
drafter's Target Layer Inference runs the target's last layers with this very code.
"""

from __future__ import annotations

import functools
import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from shared.engine import gguf, hugepages, kernels
from shared.engine.layers import (
    Block,
    KVCache,
    RMSNorm,
    Rotary,
    Span,
    attend_spans,
    attention_dtype,
    grown,
    kernel_blocks,
    run_blocks,
)
from shared.engine.linear import CUDA_ROWS, Linear, quantize
from shared.engine.padded import BUDGET_BYTES, Padded, applies
from shared.errors import SplitspecError

ARCHITECTURES = ("llama", "qwen2", "mistral")
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


@dataclass(frozen=True)
class ModelConfig:
    """The facts about a decoder the engine needs, read from a Hugging Face ``config.json``."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_hidden: int
    eps: float
    max_positions: int
    tie_embeddings: bool
    qkv_bias: bool
    out_bias: bool
    mlp_bias: bool

    @classmethod
    def from_hf(cls, hf) -> ModelConfig:
        if hf.model_type not in ARCHITECTURES:
            raise ValueError(f"model type {hf.model_type!r} is not supported by the engine; expected one of "
                             f"{', '.join(ARCHITECTURES)} (Llama-family decoders)")  # fmt: skip
        window = getattr(hf, "sliding_window", None)
        slides = getattr(hf, "use_sliding_window", hf.model_type == "mistral")
        if window and slides and window < hf.max_position_embeddings:
            raise ValueError(f"sliding-window attention ({window} tokens) is not supported by the engine")
        attention_bias = bool(getattr(hf, "attention_bias", False))
        qwen = hf.model_type == "qwen2"  # Qwen2: biases on q, k, v only
        return cls(
            model_type=hf.model_type,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
            mlp_hidden=hf.intermediate_size,
            eps=hf.rms_norm_eps,
            max_positions=hf.max_position_embeddings,
            tie_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=qwen or attention_bias,
            out_bias=attention_bias and not qwen,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        )


def rope_frequencies(hf) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention scale) for a config's rope settings, by transformers' own formulas."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf, "rope_parameters", None) or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        dim = int(dim * params.get("partial_rotary_factor", 1.0))
        base = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    if kind not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope type {kind!r} is not supported; expected default or one of "
                         f"{sorted(ROPE_INIT_FUNCTIONS)}")  # fmt: skip
    if kind == "dynamic":
        raise ValueError("dynamic NTK rope rescales with the sequence length; the engine supports static rope only")
    inv_freq, scale = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
    return inv_freq, float(scale)


class Cache:
    """A KV cache for every layer: keys and values [L, B, n_kv, capacity, d], preallocated, written by position.

    ``layers[i]`` is layer i's :class:`KVCache`, a view of the same storage, so moving an
    accepted path into place or reading a token's KV across all layers is one indexing op.
    ``B`` is a slot dimension: one forward may serve several sequences.
    """

    def __init__(self, num_layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype, device) -> None:  # fmt: skip
        shape = (num_layers, batch, kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.layers = [KVCache.over(self.k[i], self.v[i]) for i in range(num_layers)]

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def reserve(self, end: int, limit: int | None = None) -> None:
        """Room for positions [0, end): grown (doubled, at most ``limit``, contents kept) when there is not."""
        if end > self.capacity:
            self.k, self.v = (grown(t, 3, end, limit=limit) for t in (self.k, self.v))
            self.layers = [KVCache.over(k, v) for k, v in zip(self.k, self.v, strict=True)]

    def move(self, src: list[int], dst: list[int]) -> None:
        """Copy the entries at positions ``src`` to ``dst`` in every layer (an accepted path into place)."""
        if src != dst:
            s = torch.tensor(src, device=self.k.device)
            d = torch.tensor(dst, device=self.k.device)
            self.k[:, :, :, d] = self.k[:, :, :, s]
            self.v[:, :, :, d] = self.v[:, :, :, s]


class Transformer(nn.Module):
    """Embeddings, decoder blocks, final norm and LM head; module names follow a Llama checkpoint."""

    def __init__(self, cfg: ModelConfig, rotary: Rotary):
        super().__init__()
        self.cfg = cfg
        E = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, E)
        self.layers = nn.ModuleList(
            Block(E, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_hidden, cfg.eps,
                  bias=cfg.qkv_bias, out_bias=cfg.out_bias, mlp_bias=cfg.mlp_bias)  # fmt: skip
            for _ in range(cfg.num_layers)
        )
        self.norm = RMSNorm(E, cfg.eps)
        self.lm_head = Linear(E, cfg.vocab_size, bias=False)
        self.rotary = rotary
        self.exact = True  # see ``load_engine``
        self._blocks = None  # kernel_blocks(), made on first use
        self.graphs = None  # forwards on CUDA graphs (``shared.engine.graphs.use_graphs``)
        self.padded_bytes = BUDGET_BYTES  # several sequences attend as padded groups of this size (0: one at a time)
        self.fixed_rows = 0  # projections in fixed row blocks of this many (``exact_rows``): attention then in fp64
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def new_cache(self, capacity: int, batch: int = 1) -> Cache:
        c = self.cfg
        exact = self.exact and self.dtype == torch.bfloat16
        # exact bf16: on a CPU the kernels' fixed-order fp32 attention (Block._kernel_attention), else fp64 (a GPU's
        # recipe, ``exact_rows``, wherever it is applied)
        on_kernels = self.device.type == "cpu" and kernels.available() and not self.fixed_rows
        dtype = torch.float64 if exact and not on_kernels else attention_dtype(self.dtype, self.device)
        if self.lm_head.qweight is not None:  # low-bit on the kernels: an fp16 cache, half the bytes to attend over
            dtype = torch.float16
        return Cache(c.num_layers, batch, c.num_kv_heads, capacity, c.head_dim, dtype, self.device)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                cache: Cache | None = None, at: int = 0,
                trace: list[torch.Tensor] | None = None) -> torch.Tensor:  # fmt: skip
        """Final (normed) hidden states [B, T, E] of tokens ``ids`` [B, T] at integer ``positions`` [B, T].

        Their keys and values are written into ``cache`` at slot ``at``; each token attends to the
        cache slots [0, at + T) that ``mask`` [B or 1, T, at + T] allows (None: all of them). With
        ``trace`` the hidden state entering each layer is appended to it (transformers' ``hidden_states``
        but the last, which is the return value).
        """
        x = self.embed_tokens(ids)
        rope = self.rotary(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            if trace is not None:
                trace.append(x)
            x = layer(x, mask, rope, None if cache is None else cache.layers[i], at)
        return self.norm(x)

    def forward_many(self, parts: list[Part]) -> list[torch.Tensor]:
        """One forward for several sequences, each with its own cache, positions and mask: final hidden states
        [T_i, E] of each part. The projections and the MLP see all the parts' tokens as one matrix (the weights
        are read once for all); each part attends over its own cache, one at a time or in padded groups
        (``shared.engine.padded``). A part's rows do not depend on the others where the GEMMs' rows do not depend
        on the row count (int8 and bf16 on a CPU: ``Linear``)."""
        dev = self.device
        ids = torch.tensor([[t for p in parts for t in p.ids]], device=dev)
        positions = torch.tensor([[i for p in parts for i in p.positions]], device=dev)
        x = self.embed_tokens(ids)
        rope = self.rotary(positions, x.dtype)
        ends = list(itertools.accumulate(len(p.ids) for p in parts))
        bounds = list(zip([0, *ends[:-1]], ends, strict=True))
        stack = self.kernel_blocks() if x.dtype == torch.float32 and dev.type == "cpu" else None
        if stack is not None:  # every block low-bit: the whole stack in one kernel call
            for p in parts:
                p.cache.reserve(p.at + len(p.ids))
            spans = [Span(a, b, None, p.at, p.mask) for (a, b), p in zip(bounds, parts, strict=True)]
            x = run_blocks(stack, x[0], rope, [(p.cache.k, p.cache.v) for p in parts], spans)[None]
            x = self.norm(x)[0]
            return [x[a:b] for a, b in bounds]

        def spans(i: int) -> list[Span]:
            return [Span(a, b, p.cache.layers[i], p.at, p.mask) for (a, b), p in zip(bounds, parts, strict=True)]

        groups = Padded.groups(parts, bounds, self.padded_bytes) if self.padded_bytes and applies(parts, dev) else []

        def attend(i: int, attn, q, k, v) -> torch.Tensor:
            if not groups:
                return attend_spans(attn, q, k, v, spans(i))
            outs = [g.attend(i, attn, q, k, v) for g in groups]
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

        if self.graphs is not None and self.graphs.fits(x.shape[1]):
            x = self.graphs.forward(x, rope, attend)
        else:
            for i, layer in enumerate(self.layers):
                if groups:
                    x = layer.forward_attending(x, rope, functools.partial(attend, i))
                else:
                    x = layer.forward_spans(x, rope, spans(i))
            x = self.norm(x)[0]
        for g in groups:
            g.finish()
        return [x[a:b] for a, b in bounds]

    def kernel_blocks(self):
        """All the blocks as one CPU-kernel stack (``shared.engine.layers.kernel_blocks``), made once; None unless every
        block is low-bit (``load_engine`` quantises the head with them: a native model is told apart at once)."""
        if self._blocks is None and self.lm_head.qweight is not None:
            self._blocks = kernel_blocks(list(self.layers))
        return self._blocks

    def _apply(self, fn, recurse=True):
        self._blocks = None  # the tensors it holds are about to be replaced
        return super()._apply(fn, recurse)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


@dataclass
class Part:
    """One sequence's share of a ``forward_many``: tokens at positions, written into ``cache`` from slot ``at``,
    each seeing the cache slots [0, at + len) that ``mask`` [1, len, at + len] allows (None: all)."""

    ids: list[int]
    positions: list[int]
    mask: torch.Tensor | None
    cache: Cache
    at: int


WEIGHTS = ("native", "int8", "int4", "lowbit")


def load_engine(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                exact: bool = True, weights: str = "native") -> tuple[Transformer, object]:  # fmt: skip
    """The engine for the Hugging Face folder at ``path`` (config.json + safetensors), and its HF config.

    ``exact`` (bf16; on a GPU see ``exact_rows``): attention whose result for a token does not depend on how many
    tokens share its forward — the CPU kernels' fixed-order fp32 attention (``shared.engine.kernels``), or, where
    they could not be built, the KV cache and attention in fp64. Attention kernels reduce over keys in an order that
    depends on the query and key counts; in fp32 those differences survive the cast back to bf16 and flip greedy
    choices at near-ties (EAGLE's issue #212). In fp64 (bf16 products are exact there) they stay
    ~1e-16 relative, far below a bf16 or fp32 rounding step, so tree verification and plain
    decoding give bit-identical states. It costs ~0.3 ms a token and ~4 ms a 17-token tree here.
    ``weights="int8"`` (a CPU path): every projection and the LM head int8 with int8 activations, one scale per
    weight row and per activation row, exact int32 sums (``shared.engine.kernels``; a fp32 model then runs each block
    as four kernel calls, attention included). A different served target, a quarter of fp32's bytes a token,
    and exact relative to itself by construction: no row's result depends on the others in its forward.
    ``weights="int4"``: the same with the blocks' projections as Q4_1 (``shared.engine.quant.pack_int4``; the LM head
    stays int8): the built-in target comes back to exactly the 4-bit weights its GGUF ships. ``"lowbit"``: each
    projection int4 where its weight already lies on a Q4_1 grid (a checkpoint dequantised from one: int4 is then
    lossless and the fastest path), else int8.

    Drafters' own attention stays fp32: drafts never change outputs. Not for fp32 models: MKL's fp32
    GEMM rows do depend on the row count, so fp64 attention would not make them exact, only slower.
    """
    from safetensors.torch import load_file
    from transformers import AutoConfig

    path = Path(path)
    hf = AutoConfig.from_pretrained(path)
    cfg = ModelConfig.from_hf(hf)
    inv_freq, scale = rope_frequencies(hf)
    rotary = Rotary(inv_freq, scale, cfg.max_positions)
    if gguf.source_of(path) is not None:  # a GGUF's folder: the weights come from the file, a tensor at a time
        with torch.device("meta"):
            model = Transformer(cfg, rotary)
        _assign_gguf(model, gguf.load(path, cfg, weights))
        return prepare(model, dtype, device, exact, weights), hf
    index = path / "model.safetensors.index.json"
    files = ["model.safetensors"]
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    missing_files = [f for f in files if not (path / f).is_file()]
    if missing_files:
        raise FileNotFoundError(f"{path} has no {', '.join(missing_files)}: the engine loads safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(path / f)))
    state = {k.removeprefix("model."): v for k, v in state.items()}
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    with torch.device("meta"):  # no random init of weights about to be replaced
        model = Transformer(cfg, rotary)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (cfg.tie_embeddings and k == "lm_head.weight")]
    unexpected = [k for k in unexpected if "rotary_emb" not in k]
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not fit a {cfg.model_type} decoder: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")  # fmt: skip
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return prepare(model, dtype, device, exact, weights), hf


def _assign_gguf(model: Transformer, state: dict[str, torch.Tensor]) -> None:
    """Put a GGUF's tensors (``gguf.load``) in: float ones as parameters, packed ones into their ``Linear``s."""
    packed = assign_packed(model, state)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if k.rsplit(".", 1)[0] not in packed and k != "lm_head.weight"]
    if missing or unexpected:
        raise SplitspecError(f"GGUF weights do not fit the decoder: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if model.cfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight


def assign_packed(model: Transformer, state: dict[str, torch.Tensor]) -> set[str]:
    """Take the packed projections (``<layer>.qweight``, ``.qscale``, ``.tail.*``) out of ``state`` into their
    ``Linear``s, which drop their float weight; the names of those layers."""
    packed = {k.rsplit(".", 1)[0] for k in state if k.endswith(".qweight") and ".tail." not in k}
    for name in packed:
        layer = model.get_submodule(name)
        layer.qweight, layer.qscale = state.pop(f"{name}.qweight"), state.pop(f"{name}.qscale")
        layer.kernel_build = kernels.active()
        layer.weight = None
        if f"{name}.tail.qweight" in state:  # the rows after the head's, in another format
            qweight, qscale = state.pop(f"{name}.tail.qweight"), state.pop(f"{name}.tail.qscale")
            rows = qweight.shape[0] * 16  # block formats: tiles of 16 rows
            tail = Linear(layer.in_features, rows, bias=False, device="meta")
            tail.weight, tail.qweight, tail.qscale, tail.kernel_build = None, qweight, qscale, layer.kernel_build
            layer.tail = tail
    return packed


def exact_rows(model: nn.Module, rows: int = CUDA_ROWS) -> None:
    """Exact bf16 on a GPU, where cuBLAS picks a kernel by shape and a row's result depends on the rows beside it:
    every projection multiplies fixed blocks of ``rows`` rows (one shape, one kernel), the norms sum in fp64, and
    attention runs over an fp64 cache (``new_cache``; bf16 products are exact there and the sums' order leaves
    ~1e-16, far below a rounding step). Elementwise steps never mix rows. On a CPU it is that recipe rehearsed
    (``make bench-gpu DEVICE=cpu``), in place of the CPU's own. ``rows=0`` takes it off (``bench.forward`` times
    both)."""
    if isinstance(model, Transformer):
        model.fixed_rows = rows
    for m in model.modules():
        if isinstance(m, Linear):
            m.exact_rows = rows
        elif isinstance(m, RMSNorm):
            m.exact = rows > 0


def prepare(model: Transformer, dtype: torch.dtype, device: str | torch.device = "cpu", exact: bool = True,
            weights: str = "native") -> Transformer:  # fmt: skip
    """A loaded model made ready to serve: moved, cast, its projections made low-bit (``load_engine``'s
    ``weights``), on a CPU their weights put in huge pages (``hugepages.hold``); path timing
    (``shared.engine.paths``) prepares its timed slices the same way."""
    model = model.to(device=device, dtype=dtype)
    model.exact = exact
    if exact and model.dtype == torch.bfloat16 and model.device.type != "cpu":
        exact_rows(model)
    if weights not in WEIGHTS:
        raise ValueError(f"unknown weights {weights!r}; expected one of {', '.join(WEIGHTS)}")
    if weights in ("int8", "int4", "lowbit"):
        if model.device.type != "cpu":
            raise ValueError(f"low-bit weights are a CPU path; on {model.device} serve native weights")
        if model.lm_head.qweight is None:  # (a GGUF's untied head comes packed, with no float copy)
            model.lm_head.quantize("int8", keep_weight=True)  # its float weight stays: embeddings, drafters' heads
        quantize(model.layers, weights)
    if model.device.type == "cpu":
        hugepages.hold(model)
    return model.eval().requires_grad_(False)
