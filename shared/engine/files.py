"""Where the engine's files live: converted models, GGUF folders, pulled models and timing tables."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(override: str | os.PathLike | None = None) -> Path:
    """Where converted models live: the flag, else $SPLITSPEC_CACHE, else ~/.cache/splitspec."""
    return Path(override or os.environ.get("SPLITSPEC_CACHE") or Path.home() / ".cache" / "splitspec")
