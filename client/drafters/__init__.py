"""Drafters by name. Every drafter implements ``client.drafters.base.Drafter``."""

from __future__ import annotations

from client.drafters.base import Drafter, NoDrafter
from client.drafters.prompt_lookup import PromptLookup
from shared.errors import SplitspecError

DRAFTERS = {
    "none": NoDrafter,
    "prompt-lookup": PromptLookup,
}
ALIASES = {"pld": "prompt-lookup", "plain": "none"}


def make_drafter(name: str, **options) -> Drafter:
    """Build a drafter from its name (see ``DRAFTERS``)."""
    cls = DRAFTERS.get(ALIASES.get(name, name))
    if cls is None:
        raise SplitspecError(f"unknown drafter {name!r}; expected one of {', '.join([*DRAFTERS, *ALIASES])}")
    return cls(**options)


__all__ = ["DRAFTERS", "Drafter", "NoDrafter", "PromptLookup", "make_drafter"]
