"""Drafters by name. Every drafter implements ``client.drafters.base.Drafter``.

Training-free ones are built from their name; a whole model that shares the target's tokenizer drafts by its
model name (a built-in such as ``qwen2.5-coder-0.5b``, a GGUF file or a Hugging Face folder); trained ones come
from a bundle — a shipped one by name (``moa-tli1``, ``eagle``, ``independent``, ...) or any bundle folder by
path — and need the target whose frozen parts they reuse.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from client.drafters.base import Drafter, NoDrafter
from client.drafters.prompt_lookup import PastLookup, PromptLookup
from shared.errors import SplitspecError

DRAFTERS = {
    "none": NoDrafter,
    "prompt-lookup": PromptLookup,
    "past-lookup": PastLookup,
}
ALIASES = {"pld": "prompt-lookup", "plain": "none"}
TRAINED = ("moa-tli0", "moa-tli1", "moa-tli3", "eagle", "independent", "medusa")


def needs_target(name: str) -> bool:
    """Whether drafter ``name`` is a trained bundle: it reuses the target's frozen parts (embeddings, LM head, TLI
    layers), so the target must be loaded beside it, on the client too."""
    return ALIASES.get(name, name) not in DRAFTERS and not is_model(name)


def is_model(name: str) -> bool:
    """Whether drafter ``name`` is a whole language model (``client.drafters.model``): a built-in model name, a
    GGUF file, or a Hugging Face folder (its config.json names a ``model_type``; a bundle's names a ``kind``), with
    ``+lookup`` after it for prompt lookup first."""
    from shared.engine import gguf
    from shared.engine.models import builtin_names

    name = name.removesuffix("+lookup")
    if name in builtin_names():
        return True
    path = Path(name).expanduser()
    if gguf.is_gguf(path):
        return True
    config = path / "config.json"
    try:
        return config.is_file() and "model_type" in json.loads(config.read_text())
    except (OSError, ValueError):
        return False


def make_drafter(name: str, target=None, width: int | None = None, depth: int | None = None, weights: str = "auto",
                 vocab_ids: torch.Tensor | None = None, tokenizer=None, device: str | None = None,
                 **options) -> Drafter:  # fmt: skip
    """Build a drafter from its name (see ``DRAFTERS``), a model (``is_model``: its tokenizer must be ``tokenizer``'s
    or the target's; it runs on ``device``, the target's by default) or a bundle (name or path; needs ``target``).

    ``weights="int8"`` (``int4``) makes a trained drafter's own projections int8 (4-bit) and its draft head 4-bit
    (``shared.engine.kernels``): a draft step multiplies a few rows, where int8 streams a quarter of fp32's bytes.
    Drafts change, outputs never. ``auto``: int8 on a CPU when the target is served int8 or in bf16, else native.
    ``vocab_ids``: another draft vocabulary than the bundle's (``load_bundle``).
    """
    cls = DRAFTERS.get(ALIASES.get(name, name))
    if cls is not None:
        return cls(**options)
    tree = {k: v for k, v in (("width", width), ("depth", depth)) if v is not None}
    if is_model(name):
        from client.drafters.model import ModelDrafter
        from shared.engine.target import tokenizer_fingerprint

        where = device or (str(target.device) if target is not None else "cpu")  # beside the target it serves
        lm = drafter_model(name.removesuffix("+lookup"), where, weights)
        expected = tokenizer if tokenizer is not None else getattr(target, "tokenizer", None)
        if expected is not None and tokenizer_fingerprint(expected) != tokenizer_fingerprint(lm.tokenizer):
            raise SplitspecError(f"drafter {name!r} has another tokenizer than the target's (fingerprint "
                                 f"{tokenizer_fingerprint(lm.tokenizer)}, expected {tokenizer_fingerprint(expected)}): "
                                 "a model drafts only for a target whose token ids mean the same")  # fmt: skip
        return ModelDrafter(lm, lookup=name.endswith("+lookup"), **tree)
    from client.drafters.bundle import find_bundle, load_bundle

    path = find_bundle(name, target)
    if path is None:
        known = ", ".join([*DRAFTERS, *ALIASES, *TRAINED])
        raise SplitspecError(f"unknown drafter {name!r}: expected one of {known}, or the path of a drafter bundle")
    if target is None:
        raise SplitspecError(f"drafter {name!r} is a trained bundle: it needs the target model loaded beside it")
    model, config = load_bundle(path, target, vocab_ids=vocab_ids)
    prepare_drafter(model, target, weights)
    drafter = drafter_for(model, name=config["name"], **tree)
    drafter.bundle = path
    return drafter


@functools.cache
def drafter_model(name: str, device: str = "cpu", weights: str = "auto"):
    """A model loaded to draft (once a process: every drafter made from it shares its weights, each with its own
    cache): on the path measured cheapest for its shapes, int4 rounding it again if that is the cheapest (drafts
    never change outputs), or the weights pinned. On CUDA its forwards run on CUDA graphs: a small model's step is
    launch-bound there (on an H200 an inexact 1.5B forward took 20 ms eager, 5.8 ms on graphs)."""
    from shared.engine.models import load_target

    if weights not in ("auto", "native", "int8", "int4"):
        raise SplitspecError(f"unknown drafter weights {weights!r}; expected auto, native, int8 or int4")
    dtype = "float32" if weights in ("int8", "int4") else "auto"
    return load_target(name, device=device, dtype=dtype, weights=weights, rounding=True,
                       graphs=str(device).startswith("cuda"))


def prepare_drafter(model, target, weights: str = "auto") -> None:
    """A trained drafter's model made ready to draft beside ``target``: in its device and dtype, and its own layers
    low-bit where that pays (``auto``: int8 on a CPU when the target is served low-bit or in bf16; ``int4`` halves
    a step's bytes again, drafts change a little, outputs never)."""
    model.to(target.device, target.dtype)
    if weights == "auto":  # a draft step multiplies a few rows: int8 streams a quarter of fp32's bytes
        served_int8 = target.engine.lm_head.qweight is not None
        cheap = served_int8 or target.dtype == torch.bfloat16
        weights = "int8" if target.device.type == "cpu" and cheap else "native"
    if weights in ("int8", "int4"):
        quantize_drafter(model, weights)
    elif weights != "native":
        raise SplitspecError(f"unknown drafter weights {weights!r}; expected auto, native, int8 or int4")


def quantize_drafter(model, kind: str = "int8") -> None:
    """Weight-only ``kind`` (int8 or int4) for a trained drafter's own layers, and its draft head 4-bit; never the
    target's parts it shares."""
    from shared.engine.linear import quantize

    for name, child in model.named_children():
        if name != "parts":
            quantize(child, kind)
    model.parts.quantize_head()


def drafter_for(model, name: str, **tree) -> Drafter:
    """The incremental drafter that runs a trained model."""
    if model.kind == "moa":
        from client.drafters.moa import MoADrafter

        return MoADrafter(model, name=name, **tree)
    if model.kind == "eagle":
        from client.drafters.eagle import EagleDrafter

        return EagleDrafter(model, name=name, **tree)
    if model.kind == "medusa":
        from client.drafters.medusa import MedusaDrafter

        return MedusaDrafter(model, name=name, depth=tree.get("depth"))  # its tree's shape is measured, not B x D
    from client.drafters.independent import IndependentDrafter

    return IndependentDrafter(model, name=name, **tree)


__all__ = ["DRAFTERS", "TRAINED", "Drafter", "NoDrafter", "PromptLookup", "drafter_for", "make_drafter",
           "quantize_drafter"]
