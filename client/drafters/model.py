"""A whole language model as the drafter: the classic speculative pair (Qwen2.5-Coder-0.5B drafting for its 1.5B
sibling), with no training and no bundle.

Any decoder the engine loads (a built-in name, a GGUF file, a Hugging Face folder) drafts for a target whose
tokenizer it shares: same ids, same meanings (checked by fingerprint). It reads tokens only, so nothing crosses
the link but the tree, any verifier will do, and when the link is cut it is a whole model writing on its own.
It runs on the engine's fastest path for it (measured, like a target's), one KV cache written by position:
committed tokens are fed once, a tree's nodes take the slots after the root and the next tree overwrites them.

With ``lookup`` (``--drafter NAME+lookup``) a round first tries prompt lookup (``shared.lookup``): where the text
repeats its context (code quoting its prompt, edits) the copy is the draft and costs nothing; elsewhere the model
drafts. A model step costs about a third of a target step here, so every free round counts.
"""

from __future__ import annotations

import torch

from client.drafters.base import Drafter
from client.drafters.tree_drafter import TokenCache
from client.drafters.tree_search import eagle2_tree
from shared.engine import Part
from shared.features import Features
from shared.lookup import NgramLookup
from shared.tree import DraftTree, causal_from

FLOOR = 0.3  # about a 0.5B step's cost in 1.5B steps on a CPU: a deeper step must be at least that likely to pay


class ModelDrafter(TokenCache, Drafter):
    """EAGLE-2 trees (``width`` x ``depth``; width 1 is a greedy chain) from a small model's own top-k. Width 2: a
    step of a whole model costs a third of the target's here, so a narrow tree (measured: 1.37x plain on HumanEval at
    2 x 5, 8 nodes; 1.25x as a chain of 4) pays more than a wide one. ``floor``: no deeper step once the best path
    is less likely than this (``eagle2_tree``): on chat text, where the 0.5B is unsure after a token or two, it
    took MT-Bench from 0.97x to 1.11x plain and left HumanEval as it was (1.42x / 1.36x, within noise)."""

    def __init__(self, lm, width: int = 2, depth: int = 5, name: str | None = None, lookup: bool = False,
                 floor: float = FLOOR):  # fmt: skip
        self.lm = lm  # a shared.target.Target: engine and tokenizer
        self.engine = lm.engine
        self.width, self.depth, self.floor = width, depth, floor
        self.name = name or lm.name + ("+lookup" if lookup else "")
        self.lookup = NgramLookup() if lookup else None
        self.cache = self.engine.new_cache(256)
        self.tokens: list[int] = []

    @property
    def _device(self) -> torch.device:
        return self.engine.device

    @torch.inference_mode()
    def begin(self, tokens: list[int], features: Features | None = None) -> None:
        """Start a sequence and prefill the prompt into the cache now (with the target's prefill), so that the first
        drafted round does not pay for it and look, to the adaptive policy, like a drafter that cannot pay."""
        self.clear_tokens()
        if self.lookup is not None:
            self.lookup.begin([])
        self.absorb(tokens, features)
        n = len(tokens) - 1  # all but the root, which each tree feeds again
        if n > 0:
            self.cache.reserve(n)
            self.engine.forward_many([Part(tokens[:n], list(range(n)), causal_from(0, n, self._device), self.cache, 0)])
            self.fed = n

    def absorb(self, tokens: list[int], features: Features | None = None) -> None:
        super().absorb(tokens)
        if self.lookup is not None:
            self.lookup.absorb(tokens)

    def rewind(self, n: int) -> None:
        super().rewind(n)
        if n > 0 and self.lookup is not None:
            self.lookup.rewind(n)

    def discard(self) -> None:
        if self.lookup is not None:
            self.lookup.discard()

    def propose(self, max_nodes: int, depth: int | None = None) -> DraftTree:
        if max_nodes < 1 or not self.tokens:
            return DraftTree()
        if self.lookup is not None and len(copied := self.lookup.propose(max_nodes, depth)):
            return copied
        tree, scores = eagle2_tree(self, self.width, self.depth if depth is None else depth, max_nodes,
                                   floor=self.floor)  # fmt: skip
        tree.scores = scores
        return tree

    # --- TreeScorer (with TokenCache) ---

    def _logprobs(self, tokens: list[int], positions: list[int], mask: torch.Tensor | None, at: int) -> torch.Tensor:
        self.cache.reserve(at + len(tokens))
        hidden = self.engine.forward_many([Part(tokens, positions, mask, self.cache, at)])[0]
        return torch.log_softmax(self.engine.logits(hidden).float(), dim=-1)
