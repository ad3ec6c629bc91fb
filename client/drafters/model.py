"""A whole language model as the drafter: the classic speculative pair (Qwen2.5-Coder-0.5B drafting for its 1.5B
sibling), with no training and no bundle.

Any decoder the engine loads (a built-in name, a GGUF file, a Hugging Face folder) drafts for a target whose
tokenizer it shares: same ids, same meanings (checked by fingerprint). It reads tokens only, so nothing crosses
the link but the tree, any verifier will do, and when the link is cut it is a whole model writing on its own.
It runs on the engine's path cheapest for drafting (measured: ``paths.DRAFT_MIX``), one KV cache written by position:
committed tokens are fed once, a tree's nodes take the slots after the root and the next tree overwrites them.

With ``lookup`` (``--drafter NAME+lookup``) a round first tries prompt lookup (``shared.lookup``): where the text
repeats its context (code quoting its prompt, edits) the copy is the draft and costs nothing; elsewhere the model
drafts. A model step costs about a third of a target step here, so every free round counts. A copy is taken where it
expects to keep ``COPY_TOKENS`` or more (``DraftTree.kept``): on chat most miss, and a round spent on a missed copy is
a round the model's own tree, kept more often, did not draft.

A model whose vocabulary is at least 4x ``VOCAB`` drafts from a draft vocabulary: the ``VOCAB`` tokens an assistant
says most (``client.drafters.vocabulary.frequent_tokens``) and every token of the prompt. Its head is cut to those rows
(its own int8 or 4-bit values, ``Linear.rows``): the 0.5B's 152k-row head is a quarter of a step's bytes, and 16k
rows plus a prompt's cover 99.4 % of what the 1.5B writes on HumanEval prompts and 95.4 % on MT-Bench. A one-level
proposal (an offline step, the link down) reads the whole head, and never copies: it is the model's own next token,
not a draft.
"""

from __future__ import annotations

import functools

import torch

from client.drafters.base import Drafter
from client.drafters.tree_drafter import TokenCache
from client.drafters.tree_search import eagle2_tree
from shared.engine import hugepages
from shared.engine.decoder import Part
from shared.engine.linear import Linear
from shared.features import Features
from shared.lookup import NgramLookup, shared_length
from shared.tree import DraftTree, causal_from

# a copy is the round's draft where it expects to keep at least this many tokens (an unscored one of 4 tokens: 0.94); a
# copy is free and runs long where the text repeats, but on chat most miss at their first token
COPY_TOKENS = 0.75
FLOOR = 0.3  # about a 0.5B step's cost in 1.5B steps on a CPU: a deeper step must be at least that likely to pay
VOCAB = 16384  # the draft vocabulary's frequent tokens, where the model's own vocabulary is at least 4x as large


@functools.cache
def draft_head(lm, size: int) -> tuple[torch.Tensor, set[int], Linear] | None:
    """The draft vocabulary of ``size`` frequent tokens of ``lm`` (a ``Target``), as ids, a set, and its head's rows
    (shared by every drafter of ``lm``); None where its vocabulary is under 4x ``size``, or its head's rows could not
    be cut without rounding them again (``Linear.cuttable``: Q4_K, say)."""
    from client.drafters.vocabulary import frequent_tokens

    head = lm.engine.lm_head
    if head.out_features < 4 * size or not head.cuttable():
        return None
    ids = frequent_tokens(lm.tokenizer, size)
    ids = ids[ids < head.out_features]
    rows = head.rows(ids)
    hugepages.hold(rows)  # read every step, as the whole head was
    return ids, set(ids.tolist()), rows


class ModelDrafter(TokenCache, Drafter):
    """EAGLE-2 trees (``width`` x ``depth``; width 1 is a greedy chain) from a small model's own top-k. Width 2: a
    step of a whole model costs a third of the target's here, so a narrow tree (measured: 1.37x plain on HumanEval at
    2 x 5, 8 nodes; 1.25x as a chain of 4) pays more than a wide one. ``floor``: no deeper step once the best path
    is less likely than this (``eagle2_tree``): on chat text, where the 0.5B is unsure after a token or two, it
    took MT-Bench from 0.97x to 1.11x plain and left HumanEval as it was (1.42x / 1.36x, within noise)."""

    def __init__(self, lm, width: int = 2, depth: int = 5, name: str | None = None, lookup: bool = False,
                 floor: float = FLOOR, vocab: int | None = VOCAB):  # fmt: skip
        self.lm = lm  # a shared.engine.target.Target: engine and tokenizer
        self.engine = lm.engine
        self.width, self.depth, self.floor = width, depth, floor
        self.name = name or lm.name + ("+lookup" if lookup else "")
        self.lookup = NgramLookup() if lookup else None
        self.cache = self.engine.new_cache(256)
        self.clear_tokens()  # no sequence yet: an empty cache
        self.vocabulary = draft_head(lm, vocab) if vocab else None  # (ids, their set, the head's rows) or None
        self.extra: tuple[torch.Tensor, Linear] | None = None  # the prompt's tokens outside it, and their rows
        self.vocab_ids: torch.Tensor | None = None  # what each index of a drafted distribution is (None: itself)
        self.whole = True  # this search reads the whole head
        self.prepared: list[int] | None = None  # the prompt ``prepare`` prefilled into the cache, for ``begin``

    @property
    def _device(self) -> torch.device:
        return self.engine.device

    @torch.inference_mode()
    def prepare(self, prompt_ids: list[int]) -> None:
        """Prefill the prompt while the server prefills it: the first token then waits for the slower of the two,
        not for both in turn (the 0.5B's prefill of a HumanEval prompt: a third of a second on one core)."""
        self.prepared = None
        self._prefill(prompt_ids, self.tokens[: self.fed])
        self.prepared = list(prompt_ids)

    def _prefill(self, ids: list[int], held: list[int]) -> None:
        """``ids`` into the cache from slot 0: the prompt, all but the root (which each tree feeds again). ``held``:
        the tokens the cache holds now (the last sequence's); a prompt that extends them (a conversation's next turn)
        runs only from where the two part."""
        start = shared_length(held, ids)
        if start < len(ids):
            self.cache.reserve(len(ids))
            self.engine.forward_many([Part(ids[start:], list(range(start, len(ids))),
                                           causal_from(start, len(ids) - start, self._device), self.cache, start)])

    @torch.inference_mode()
    def begin(self, tokens: list[int], features: Features | None = None) -> None:
        """Start a sequence and prefill the prompt into the cache now (with the target's prefill) unless ``prepare``
        did, so that the first drafted round does not pay for it and look, to the adaptive policy, like a drafter
        that cannot pay."""
        prepared, self.prepared = self.prepared, None
        held = prepared if prepared is not None else self.tokens[: self.fed]  # what the cache holds now
        self.clear_tokens()
        if self.vocabulary is not None:
            ids, known, _ = self.vocabulary
            new = torch.tensor(sorted(set(tokens) - known), dtype=torch.long)
            self.extra = (new, self.engine.lm_head.rows(new)) if len(new) else None
            self.vocab_ids = torch.cat([ids, new])
        super().absorb(tokens)
        if self.lookup is not None:
            self.lookup.begin(tokens)  # (the last generation's answer joins its past answers)
        n = len(tokens) - 1  # all but the root, which each tree feeds again
        if prepared != tokens[:n]:
            self._prefill(tokens[:n], held)
        self.fed = max(n, 0)

    def absorb(self, tokens: list[int], features: Features | None = None) -> None:
        super().absorb(tokens)
        if self.lookup is not None:
            self.lookup.absorb(tokens)

    def held_bytes(self) -> int:
        return self.cache.nbytes

    def rewind(self, n: int) -> None:
        super().rewind(n)
        if n > 0 and self.lookup is not None:
            self.lookup.rewind(n)

    def propose(self, max_nodes: int, depth: int | None = None) -> DraftTree:
        if max_nodes < 1 or not self.tokens:
            return DraftTree()
        # an offline step (one level, the link down) is the model's own token: a copy there has no probability to
        # judge it by, and copies of the offline text itself loop (measured on the pair: a 13-token cycle, none kept)
        if self.lookup is not None and depth != 1 and len(copied := self.lookup.propose(max_nodes, depth)):
            if copied.kept is None or sum(copied.kept) >= COPY_TOKENS:
                return copied  # else the model drafts; the copy is still scored against the text that comes
        depth = self.depth if depth is None else depth
        self.whole = self.vocab_ids is None or depth == 1  # one level: an offline step, the model's own token
        tree, scores = eagle2_tree(self, self.width, depth, max_nodes, floor=self.floor,
                                   vocab_ids=None if self.whole else self.vocab_ids)  # fmt: skip
        tree.scores = scores
        return tree

    # --- TreeScorer (with TokenCache) ---

    def _logprobs(self, tokens: list[int], positions: list[int], mask: torch.Tensor | None, at: int) -> torch.Tensor:
        self.cache.reserve(at + len(tokens))
        hidden = self.engine.forward_many([Part(tokens, positions, mask, self.cache, at)])[0]
        if self.whole:
            return torch.log_softmax(self.engine.logits(hidden).float(), dim=-1)
        ids, _, rows = self.vocabulary
        logits = [rows(hidden)[..., : len(ids)]]
        if self.extra is not None:
            logits.append(self.extra[1](hidden)[..., : len(self.extra[0])])
        return torch.log_softmax(torch.cat(logits, dim=-1).float(), dim=-1)
