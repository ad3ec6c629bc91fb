"""Finding drafter bundles and checking them against a target: what both sides need of a bundle.

A bundle is a folder: ``weights.safetensors`` (the trainable weights only) and ``config.json``
(format, kind, TLI, dimensions, the target's name and tokenizer fingerprint, the training
budget). The client builds whole drafters from bundles (``client.drafters.bundle``); the server
only ever loads a MoA bundle's LSA (``shared.lsa``), for payload form ``lsa``. Either way the
bundle is checked first, so a drafter is never paired with a target whose token ids or shapes
mean something else.
"""

from __future__ import annotations

import glob
import json
from pathlib import Path

from shared.errors import SplitspecError

FORMAT = "splitspec-drafter/1"
SCALE = ".int8_scale"  # an int8 weight ``w`` is stored as ``w`` (int8 rows) and ``w.int8_scale`` (one float16 per row)
MIN_INT8 = 4096  # smaller tensors (norms, biases, position tables) stay float16
SHIPPED = Path(__file__).resolve().parent.parent / "client" / "drafters" / "bundles"  # trained ones in git


def find_bundle(name_or_path: str, search: tuple[Path, ...] = (SHIPPED,),
                fingerprint: str | None = None) -> Path | None:  # fmt: skip
    """A bundle by name in the ``search`` folders — directly in one (``bundles/moa-tli1``) or in a target's folder
    there (``bundles/qwen2.5-coder-1.5b/moa-tli1``), the one trained for tokenizer ``fingerprint`` first, so one name
    serves every target that has a bundle of it — or a folder path holding config.json; None when neither. A name
    whose bundles were all trained for other targets gives one of them: ``read_bundle`` then says which target."""
    named = []
    if name_or_path and "/" not in name_or_path and not name_or_path.startswith("."):
        for d in map(Path, search):
            candidates = (d / name_or_path, *sorted(d.glob(f"*/{glob.escape(name_or_path)}")))
            named += [c for c in candidates if (c / "config.json").is_file()]
    if fingerprint is not None:
        for candidate in named:
            if trained_for(candidate) == fingerprint:
                return candidate
    if named:
        return named[0]
    path = Path(name_or_path).expanduser()
    return path if (path / "config.json").is_file() else None


def trained_for(path: Path) -> str | None:
    """The tokenizer fingerprint of the target a bundle was trained for (None: no readable config)."""
    try:
        return json.loads((Path(path) / "config.json").read_text())["target"]["tokenizer_fingerprint"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_bundle(path: Path, target) -> dict:
    """A bundle's config, after checking its format, tokenizer fingerprint and dimensions against ``target``."""
    path = Path(path)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise SplitspecError(f"{path} is not a drafter bundle: {exc}") from None
    if config.get("format") != FORMAT:
        raise SplitspecError(f"{path}: bundle format {config.get('format')!r}, expected {FORMAT!r}")
    want = config["target"]
    if want["tokenizer_fingerprint"] != target.fingerprint:
        raise SplitspecError(
            f"drafter bundle {path} was trained for target {want['name']!r} "
            f"(tokenizer {want['tokenizer_fingerprint']}), but the target here is {target.name!r} "
            f"(tokenizer {target.fingerprint}); use a bundle made for it"
        )
    for key in ("vocab_size", "hidden_size", "num_layers"):
        if want[key] != getattr(target, key):
            raise SplitspecError(
                f"drafter bundle {path} expects a target with {key}={want[key]}, this one has {getattr(target, key)}"
            )
    return config


def pack_weights(state: dict, dtype: str) -> dict:
    """A drafter's weights as a bundle stores them: ``float16``/``float32`` as they are, or ``int8`` — each
    matrix of at least MIN_INT8 values rounded per row to 127 levels of its largest magnitude, half the bytes of
    float16, so a drafter for a 1.5B target fits a small bundle. A drafter's precision changes how often it is
    right, never what the target accepts."""
    import torch

    if dtype not in ("float16", "float32", "int8"):
        raise SplitspecError(f"bundle weights dtype {dtype!r}; expected float16, float32 or int8")
    out = {}
    for name, v in state.items():
        v = v.detach().to("cpu")
        if not v.is_floating_point():
            out[name] = v.contiguous()
        elif dtype == "int8" and v.dim() == 2 and v.numel() >= MIN_INT8:
            scale = (v.float().abs().amax(dim=1) / 127).to(torch.float16).clamp_min(2**-24)  # as stored
            out[name] = torch.round(v.float() / scale.float()[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
            out[name + SCALE] = scale
        else:
            out[name] = v.to(torch.float32 if dtype == "float32" else torch.float16).contiguous()
    return out


def read_weights(path: Path) -> dict:
    """A bundle's weights as float tensors (int8 ones multiplied back by their row scales), ids as stored."""
    import torch
    from safetensors.torch import load_file

    state = load_file(str(Path(path) / "weights.safetensors"))
    for name in [k for k in state if k.endswith(SCALE)]:
        base = name.removesuffix(SCALE)
        state[base] = state[base].float() * state.pop(name).float()[:, None]
    return {k: v.float() if v.is_floating_point() and v.dtype != torch.float32 else v for k, v in state.items()}
