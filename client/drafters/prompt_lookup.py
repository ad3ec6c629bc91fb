"""The prompt-lookup drafter: ``shared.lookup.NgramLookup`` (which the server also drafts with) as a Drafter."""

from __future__ import annotations

from client.drafters.base import Drafter
from shared import lookup


class PromptLookup(lookup.NgramLookup, Drafter):
    name = "prompt-lookup"
