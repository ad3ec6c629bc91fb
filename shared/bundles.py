"""Finding drafter bundles and checking them against a target: what both sides need of a bundle.

A bundle is a folder: ``weights.safetensors`` (the trainable weights only) and ``config.json``
(format, kind, TLI, dimensions, the target's name and tokenizer fingerprint, the training
budget). The client builds whole drafters from bundles (``client.drafters.bundle``); the server
only ever loads a MoA bundle's LSA (``shared.lsa``), for payload mode ``lsa``. Either way the
bundle is checked first, so a drafter is never paired with a target whose token ids or shapes
mean something else.
"""

from __future__ import annotations

import json
from pathlib import Path

from shared.errors import SplitspecError

FORMAT = "splitspec-drafter/1"
SHIPPED = Path(__file__).resolve().parent.parent / "client" / "drafters" / "bundles"  # trained ones in git


def find_bundle(name_or_path: str, search: tuple[Path, ...] = (SHIPPED,)) -> Path | None:
    """A bundle by name in the ``search`` folders, or a folder path holding config.json; None when neither."""
    for candidate in (*(Path(d) / name_or_path for d in search), Path(name_or_path).expanduser()):
        if (candidate / "config.json").is_file():
            return candidate
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
