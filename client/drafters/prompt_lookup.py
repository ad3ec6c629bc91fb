"""The prompt-lookup drafter: ``shared.lookup.NgramLookup`` (which the server also drafts with) as a Drafter."""

from __future__ import annotations

from client.drafters.base import Drafter
from shared import lookup


class PromptLookup(lookup.NgramLookup, Drafter):
    name = "prompt-lookup"


class PastLookup(PromptLookup):
    """Prompt lookup that also copies from this client's earlier answers (``lookup.PAST_TOKENS`` of them) where the
    text has no match: what an agent repeats across requests. Its own name, not the default: with it a seeded
    sampled answer depends on the requests before it."""

    name = "past-lookup"

    def __init__(self, **options) -> None:
        super().__init__(**{"past_tokens": lookup.PAST_TOKENS, **options})
