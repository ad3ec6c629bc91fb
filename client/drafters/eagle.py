"""The EAGLE drafter (Li et al., 2024): one decoder layer that extrapolates the target's features.

A *feature* f_t is the target's final (normed) hidden state at position t: the LM head turns it
into the distribution of token t+1. Features are far more predictable than tokens, so EAGLE
predicts the next feature, f̂_t from [f_{t-1} ‖ embedding of x_t] through a linear map and one
Llama block, and reads its tokens off the target's own (frozen) LM head.

It is "1-step bounded": the true f_{t-1} exists only for committed tokens, so deeper draft
nodes feed on the drafter's own predicted features, and errors compound along a path. Training
is teacher-forced on true features, with uniform noise on them so that the drafter learns to
cope with its own slightly-off inputs.
"""

from __future__ import annotations

import torch

from client.drafters.target_parts import BlockShape, DrafterModel, TargetParts
from client.drafters.tree_drafter import DraftNodes, TreeDrafter
from shared.engine.layers import Block, KVCache
from shared.engine.linear import Linear
from shared.features import Features
from shared.lookup import shared_length
from shared.tree import causal_from, causal_mask


class EagleConfig(BlockShape):
    """One block the target's shape; features are the target's hidden states (E wide)."""


class Eagle(DrafterModel):
    """Trainable fc (2E -> E) and one causal block; the target's embeddings and LM head, frozen, in ``parts``."""

    kind = "eagle"
    payload_forms = ("hidden",)  # the target's final hidden states

    def __init__(self, cfg: EagleConfig, parts: TargetParts):
        super().__init__()
        self.needs_final_state(parts)
        self.cfg = cfg
        E = cfg.hidden_size
        self.fc = Linear(2 * E, E)  # (ours: int8 with the rest of a drafter's own layers, ``quantize_drafter``)
        self.block = Block(E, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.mlp_hidden, cfg.eps)
        self.parts = parts

    def forward(self, features: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                cache: KVCache | None = None, at: int = 0) -> torch.Tensor:  # fmt: skip
        """Predicted features f̂_p [B, n, E] of tokens x_p at integer ``positions`` p [B, n], given f_{p-1} [B, n, E].

        With ``cache`` the block's keys and values are written at slot ``at`` and every cached slot
        that ``mask`` [1, n, at + n] allows is attended to.
        """
        dtype = self.block.input_layernorm.weight.dtype
        x = self.fc(torch.cat([features.to(dtype), self.parts.embed(input_ids).to(dtype)], dim=-1))
        return self.block(x, mask, self.parts.rope(positions, dtype), cache, at)

    def forward_train(self, features: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Teacher-forced over whole sequences [B, T]: f̂_p for p = 1..T-1 ([B, T-1, E]) from f_{p-1} = features[:, p-1].

        Position 0 has no previous feature and is never fed, here or when drafting.
        """
        B, T = input_ids.shape
        positions = torch.arange(1, T, device=input_ids.device).expand(B, T - 1)
        return self(features[:, : T - 1], input_ids[:, 1:], positions, causal_mask(T - 1, input_ids.device))

class EagleDrafter(TreeDrafter):
    """Incremental EAGLE drafting: true features for committed tokens, predicted ones inside a tree.

    Position p (>= 1) sits at cache slot p - 1 and is fed [f_{p-1} ‖ e(x_p)]. Committed positions
    are fed when a tree starts, with the target's features (all but the root's arrive with each
    verification), up to and including the root, whose output f̂_root drafts the first level. A
    draft node feeds on its parent's predicted feature and takes the slots after the root; those
    are overwritten by the next tree, so tokens accepted from a tree are fed again with true features.
    """

    kept = 0  # positions the next ``begin`` keeps (``keep_for``)

    def keep_for(self, prompt_ids: list[int]) -> int:
        self.kept = min(shared_length(prompt_ids, getattr(self, "tokens", ())), getattr(self, "cached", 0))
        return self.kept

    def begin(self, tokens: list[int], features: Features | None = None) -> None:
        kept, self.kept = self.kept, 0
        if kept and (features is None or len(features) == 0 or features.start == kept):
            # a conversation's next turn: its first ``kept`` positions as they are (their cache slots, their
            # features), what follows fed again
            self.tokens, self.known, self.cached = self.tokens[:kept], self.known[:kept], kept
            self.fed, self.root_feature = min(self.fed, kept), None
            self.end_tree()
            self.absorb(tokens[kept:], features)
            return
        self.tokens: list[int] = []
        self.fed = 1  # positions [1, fed) are in the cache, fed with true features
        self.cached = 0  # positions whose target features arrived (all but the root)
        self.known = torch.empty(0, self.model.cfg.hidden_size, device=self._device, dtype=self._dtype)  # f_0, f_1..
        self.cache = KVCache()
        self.root_feature = None  # f̂ of the current root, from its last root_logprobs
        self.end_tree()
        self.absorb(tokens, features)

    def absorb(self, tokens: list[int], features: Features | None = None) -> None:
        if (features is None or len(features) == 0) and tokens and self.root_feature is not None:
            # a token committed without the target (offline): the root's own predicted feature stands in
            # for the true one the target would have sent, until a verification replaces it
            if len(self.known) == len(self.tokens) - 1:
                self.known = torch.cat([self.known, self.root_feature[None]])
        self.tokens += tokens
        if features is None or len(features) == 0:
            return
        if features.start != self.cached or features.hidden is None:
            raise ValueError(f"EAGLE needs hidden features from position {self.cached}, got {features}")
        hidden = features.hidden.to(self._device, self._dtype)
        self.known = torch.cat([self.known[: self.cached], hidden])
        self.cached = features.start + hidden.shape[0]
        # positions fed on stand-ins (``assume``) are fed again on the target's features: position p reads f_{p-1}
        self.fed = min(self.fed, features.start + 1)

    def rewind(self, n: int) -> None:
        if n > 0:
            self.tokens = self.tokens[:-n]
            self.fed = min(self.fed, len(self.tokens))
            self.cached = min(self.cached, len(self.tokens) - 1)
            self.known = self.known[: len(self.tokens) - 1]
            self.root_feature = None

    # --- TreeScorer ---

    def _predict(self, features: torch.Tensor, tokens: list[int], positions: list[int], mask: torch.Tensor,
                 at: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Predicted features [1, n, E] of new tokens fed at slot ``at``, and their next-token log-probs [n, V]."""
        ids = torch.tensor([tokens], device=self._device)
        out = self.model(features[None], ids, torch.tensor([positions], device=self._device), mask, self.cache, at)
        return out, torch.log_softmax(self.model.parts.logits(out[0]).float(), dim=-1)

    @torch.inference_mode()
    def root_logprobs(self) -> torch.Tensor:
        root = len(self.tokens) - 1
        start = min(self.fed, root)  # the root is always fed (again): its output is what drafts
        mask = causal_from(start - 1, root + 1 - start, self._device)
        out, logprobs = self._predict(self.known[start - 1 : root], self.tokens[start:], list(range(start, root + 1)),
                                      mask, start - 1)  # fmt: skip
        self.fed = root + 1
        self.nodes = DraftNodes(root, root)  # the root sits at slot root - 1
        self.node_features = out[0, -1:]  # the root's f̂ first, then each node's, in feeding order
        self.root_feature = out[0, -1]
        return logprobs[-1]

    @torch.inference_mode()
    def expand(self, tokens: list[int], parents: list[int]) -> torch.Tensor:
        positions, at, mask = self.nodes.add(parents, self._device)
        inputs = self.node_features[[p + 1 for p in parents]]  # each parent's predicted feature (row 0: the root)
        out, logprobs = self._predict(inputs, tokens, positions, mask, at)
        self.node_features = torch.cat([self.node_features, out[0]])
        return logprobs

    def end_tree(self) -> None:
        self.nodes = DraftNodes(0, 0)
        self.node_features = None

    def can_draft(self) -> bool:
        root = len(self.tokens) - 1
        return root >= 1 and len(self.known) >= root  # the root's input needs f_{root-1} (true or stand-in)
