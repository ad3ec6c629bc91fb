"""The drafter interface: the decode loop, benchmarks and fallback talk only to this."""

from __future__ import annotations

from abc import ABC, abstractmethod

from shared.tree import DraftTree


class Drafter(ABC):
    """Proposes draft trees after the committed sequence and learns what the target kept.

    The committed sequence always ends with the *root*: the newest token, which the target has
    chosen but not yet run. ``propose`` drafts continuations of it.
    """

    name: str = "drafter"
    #: what the drafter needs the target to report about newly cached tokens (see shared.features)
    features: frozenset[str] = frozenset()
    #: how many of the target's last layers the drafter runs itself (MoA's Target Layer Inference)
    tli: int = 0
    #: the bundle folder a trained drafter was loaded from (payload mode lsa names it to the server)
    bundle = None

    @abstractmethod
    def begin(self, tokens: list[int], payload: object | None = None) -> None:
        """Start a new sequence: prompt plus the first generated token, with the prompt's features."""

    @abstractmethod
    def propose(self, max_nodes: int, depth: int | None = None) -> DraftTree:
        """A tree of at most ``max_nodes`` drafted tokens (may be empty), at most ``depth`` deep if given
        (tree drafters; the adaptive policy sets it)."""

    @abstractmethod
    def absorb(self, tokens: list[int], payload: object | None = None) -> None:
        """Append newly committed tokens (accepted drafts + bonus), with what the server sent about them."""

    @abstractmethod
    def rewind(self, n: int) -> None:
        """Forget the last ``n`` committed tokens (reconciliation after a divergence)."""


class NoDrafter(Drafter):
    """Plain target decoding: every round verifies an empty tree and yields one token."""

    name = "none"

    def begin(self, tokens: list[int], payload: object | None = None) -> None:
        pass

    def propose(self, max_nodes: int, depth: int | None = None) -> DraftTree:
        return DraftTree()

    def absorb(self, tokens: list[int], payload: object | None = None) -> None:
        pass

    def rewind(self, n: int) -> None:
        pass
