"""Drafter bundles: a trained drafter's own weights plus what it was trained for and with.

A bundle is a folder: ``weights.safetensors`` (the trainable weights only — the frozen target
parts are re-extracted from the loaded target) and ``config.json`` (format, kind, TLI,
dimensions, the target's name and tokenizer fingerprint, the training budget). Loading checks
the fingerprint and dimensions against the target at hand, so a drafter is never silently
paired with a target whose token ids or shapes mean something else.

Shipped bundles live in ``client/drafters/bundles/<name>`` and are found by name
(``--drafter moa-tli1``); any other bundle by its path.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from shared import bundles as shared_bundles
from shared.bundles import FORMAT, SHIPPED
from shared.errors import SplitspecError

DRAFT_VOCAB = "draft_vocab"  # token ids of a pruned draft vocabulary, kept beside the weights


def model_classes() -> dict:
    from client.drafters.eagle import Eagle, EagleConfig
    from client.drafters.independent import Independent, IndependentConfig
    from client.drafters.medusa import Medusa, MedusaConfig
    from client.drafters.moa import MoA, MoAConfig

    return {"moa": (MoA, MoAConfig), "eagle": (Eagle, EagleConfig), "independent": (Independent, IndependentConfig),
            "medusa": (Medusa, MedusaConfig)}


def bundle_name(kind: str, tli: int = 0) -> str:
    return f"moa-tli{tli}" if kind == "moa" else kind


def save_bundle(model, path: Path, target, training: dict, dtype: str = "float16") -> Path:
    """Write a bundle atomically (a temporary folder renamed into place); ``dtype``: float16, float32 or int8
    (``shared.bundles.pack_weights``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    config = {
        "format": FORMAT,
        "kind": model.kind,
        "tli": getattr(model.cfg, "tli", 0),
        "name": bundle_name(model.kind, getattr(model.cfg, "tli", 0)),
        "model": model.cfg.to_dict(),
        "target": {"name": target.name, "tokenizer_fingerprint": target.fingerprint, "vocab_size": target.vocab_size,
                   "hidden_size": target.hidden_size, "num_layers": target.num_layers},  # fmt: skip
        "weights_dtype": dtype,
        "training": training,
    }
    state = shared_bundles.pack_weights(model.trainable_state(), dtype)
    if model.parts.vocab_ids is not None:
        state[DRAFT_VOCAB] = model.parts.vocab_ids.detach().to("cpu").contiguous()
        config["draft_vocab_size"] = len(model.parts.vocab_ids)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    tmp.chmod(0o755)
    save_file(state, str(tmp / "weights.safetensors"))
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if path.exists():
        old = path.with_name(f".{path.name}.old")
        os.replace(path, old)
        os.replace(tmp, path)
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    else:
        os.replace(tmp, path)
    return path


def find_bundle(name_or_path: str, target=None) -> Path | None:
    """A shipped bundle by name (the one trained for ``target``, where several targets have one of that name), or a
    folder holding config.json; None when neither."""
    fingerprint = getattr(target, "fingerprint", None)
    return shared_bundles.find_bundle(name_or_path, (SHIPPED,), fingerprint)


def load_bundle(path: Path, target, device=None, dtype: torch.dtype | None = None,
                vocab_ids: torch.Tensor | None = None):  # fmt: skip
    """(model, config) for the bundle at ``path``, built on ``target``'s frozen parts; refuses a mismatch.

    ``vocab_ids`` replaces the bundle's draft vocabulary (an empty tensor: the target's whole vocabulary). A
    drafter's head is the target's own frozen LM head cut to a vocabulary, so any vocabulary fits the trained
    weights; the bundle's is the one its training's KL saw, others are for measuring what size pays."""
    from client.drafters.target_parts import TargetParts

    path = Path(path)
    config = shared_bundles.read_bundle(path, target)
    classes = model_classes()
    if config["kind"] not in classes:
        raise SplitspecError(f"{path}: unknown drafter kind {config['kind']!r}; expected one of {sorted(classes)}")
    model_cls, cfg_cls = classes[config["kind"]]
    cfg = cfg_cls(**config["model"])
    state = shared_bundles.read_weights(path)
    saved = state.pop(DRAFT_VOCAB, None)
    vocab_ids = saved if vocab_ids is None else vocab_ids
    model = model_cls(cfg, TargetParts(target, getattr(cfg, "tli", 0), vocab_ids))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("parts.")]
    if missing or unexpected:
        raise SplitspecError(f"{path}: weights do not fit {config['kind']}: missing {missing}, unexpected {unexpected}")
    model.to(device or target.device, dtype or target.dtype)
    return model.eval(), config
