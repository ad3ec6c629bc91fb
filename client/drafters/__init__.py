"""Drafters by name. Every drafter implements ``client.drafters.base.Drafter``.

Training-free ones are built from their name; trained ones come from a bundle — a shipped one
by name (``moa-tli1``, ``eagle``, ``independent``, ...) or any bundle folder by path — and need
the target whose frozen parts they reuse.
"""

from __future__ import annotations

import torch

from client.drafters.base import Drafter, NoDrafter
from client.drafters.prompt_lookup import PromptLookup
from shared.errors import SplitspecError

DRAFTERS = {
    "none": NoDrafter,
    "prompt-lookup": PromptLookup,
}
ALIASES = {"pld": "prompt-lookup", "plain": "none"}
TRAINED = ("moa-tli0", "moa-tli1", "moa-tli3", "eagle", "independent", "medusa")


def needs_target(name: str) -> bool:
    """Whether drafter ``name`` is a trained bundle: it reuses the target's frozen parts (embeddings, LM head, TLI
    layers), so the target must be loaded beside it, on the client too."""
    return ALIASES.get(name, name) not in DRAFTERS


def make_drafter(name: str, target=None, width: int | None = None, depth: int | None = None, weights: str = "auto",
                 vocab_ids: torch.Tensor | None = None, **options) -> Drafter:  # fmt: skip
    """Build a drafter from its name (see ``DRAFTERS``) or from a bundle (name or path; needs ``target``).

    ``weights="int8"`` makes a trained drafter's own projections and draft head int8 (``shared.kernels``): a
    draft step multiplies a few rows, where int8 streams a quarter of fp32's bytes. Drafts change, outputs
    never. ``auto``: int8 on a CPU when the target is served int8 or in bf16, else native.
    ``vocab_ids``: another draft vocabulary than the bundle's (``load_bundle``).
    """
    cls = DRAFTERS.get(ALIASES.get(name, name))
    if cls is not None:
        return cls(**options)
    from client.drafters.bundle import find_bundle, load_bundle

    path = find_bundle(name)
    if path is None:
        known = ", ".join([*DRAFTERS, *ALIASES, *TRAINED])
        raise SplitspecError(f"unknown drafter {name!r}: expected one of {known}, or the path of a drafter bundle")
    if target is None:
        raise SplitspecError(f"drafter {name!r} is a trained bundle: it needs the target model loaded beside it")
    model, config = load_bundle(path, target, vocab_ids=vocab_ids)
    prepare_drafter(model, target, weights)
    tree = {k: v for k, v in (("width", width), ("depth", depth)) if v is not None}
    drafter = drafter_for(model, name=config["name"], **tree)
    drafter.bundle = path
    return drafter


def prepare_drafter(model, target, weights: str = "auto") -> None:
    """A trained drafter's model made ready to draft beside ``target``: in its device and dtype, and its own layers
    int8 where that pays (``auto``: on a CPU when the target is served low-bit or in bf16)."""
    model.to(target.device, target.dtype)
    if weights == "auto":  # a draft step multiplies a few rows: int8 streams a quarter of fp32's bytes
        served_int8 = target.engine.lm_head.qweight is not None
        cheap = served_int8 or target.dtype == torch.bfloat16
        weights = "int8" if target.device.type == "cpu" and cheap else "native"
    if weights == "int8":
        quantize_drafter(model)
    elif weights != "native":
        raise SplitspecError(f"unknown drafter weights {weights!r}; expected auto, native or int8")


def quantize_drafter(model) -> None:
    """Weight-only int8 for a trained drafter's own layers and draft head, never the target's parts it shares."""
    from shared.layers import quantize

    for name, child in model.named_children():
        if name != "parts":
            quantize(child)
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
