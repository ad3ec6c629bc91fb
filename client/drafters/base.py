"""The drafter interface: the decode loop, benchmarks and fallback talk only to this."""

from __future__ import annotations

from abc import ABC, abstractmethod

from shared.features import Features
from shared.payload import PayloadSpec, feature_kinds
from shared.tree import DraftTree

DRAFT_PRECISIONS = ("fp16", "int8", "int4")  # payload precisions a drafter asks for by default, most faithful
# first (of the codec's PRECISIONS: fp32 only on request)


class Drafter(ABC):
    """Proposes draft trees after the committed sequence and learns what the target kept.

    The committed sequence always ends with the *root*: the newest token, which the target has
    chosen but not yet run. ``propose`` drafts continuations of it.
    """

    name: str = "drafter"
    #: how many of the target's last layers the drafter runs itself (MoA's Target Layer Inference)
    tli: int = 0
    #: the bundle folder a trained drafter was loaded from (payload form lsa names it to the server)
    bundle = None

    def payload_specs(self, precisions: tuple[str, ...] = DRAFT_PRECISIONS) -> list[PayloadSpec]:
        """The payloads this drafter can draft from, most faithful first ([]: it needs nothing from the target).

        The one declaration of a drafter's needs: the verifier keeps those it can send, the loop opens
        with the first, the adaptive policy switches among them."""
        return []

    @property
    def feature_kinds(self) -> frozenset[str]:
        """What a target session must keep for this drafter ("kv" and/or "hidden"), from its payload specs."""
        return frozenset().union(*(feature_kinds(s) for s in self.payload_specs()))

    def prepare(self, prompt_ids: list[int]) -> None:
        """What can be done before the target's first answer, while the server prefills the prompt (two machines,
        both busy): a whole model prefills the prompt here, so that ``begin`` after it has only the first token
        left. Nothing by default."""
        return None

    def keep_for(self, prompt_ids: list[int]) -> int:
        """Keep, for the next ``begin``, what this drafter holds of ``prompt_ids``'s first tokens (from the sequence
        it goes on from: a conversation's last turn), and say how many tokens' target features that is: the opening
        asks the server for the features after them only. 0 by default: ``begin`` starts afresh."""
        return 0

    @abstractmethod
    def begin(self, tokens: list[int], features: Features | None = None) -> None:
        """Start a new sequence: prompt plus the first generated token, with the prompt's features."""

    @abstractmethod
    def propose(self, max_nodes: int, depth: int | None = None) -> DraftTree:
        """A tree of at most ``max_nodes`` drafted tokens (may be empty), at most ``depth`` deep if given
        (tree drafters; the adaptive policy sets it)."""

    @abstractmethod
    def absorb(self, tokens: list[int], features: Features | None = None) -> None:
        """Append newly committed tokens (accepted drafts + bonus), with the target's features of them."""

    @abstractmethod
    def rewind(self, n: int) -> None:
        """Forget the last ``n`` committed tokens (the settlement after a divergence)."""

    def assume(self, tokens: list[int]) -> None:
        """Take ``tokens`` as committed before the target has seen them (a cut, or drafting ahead of a verdict):
        a drafter fed by the target's features stands in its own — a drafting step a token, as when it writes
        alone — until ``absorb`` brings the target's for them (or ``rewind`` takes the tokens back)."""
        for token in tokens:
            self.propose(1, 1)
            self.absorb([token])

    def discard(self) -> None:
        """The last proposal will not be verified (a rehearsal during a stream): the tokens absorbed next are not
        its verdict. Only a drafter that learns from its verdicts needs to forget it."""
        return None

    def held_bytes(self) -> int:
        """Memory the drafter holds for the sequence it goes on from (a whole model's KV cache): what the edge weighs
        when it keeps idle clients for a conversation's next turn."""
        return 0


class NoDrafter(Drafter):
    """Plain target decoding: every round verifies an empty tree and yields one token."""

    name = "none"

    def begin(self, tokens: list[int], features: Features | None = None) -> None:
        pass

    def propose(self, max_nodes: int, depth: int | None = None) -> DraftTree:
        return DraftTree()

    def absorb(self, tokens: list[int], features: Features | None = None) -> None:
        pass

    def rewind(self, n: int) -> None:
        pass
