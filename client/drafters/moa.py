"""The Mixture-of-Attentions drafter (MoA): LSA, SA, CA and Target Layer Inference.

* Layer Self-Attention (LSA): a verified token's K and V from every target layer form a short
  sequence (positions = layer indices); one bidirectional block mixes them, a mean pools them,
  a linear map gives one memory vector per verified token. It runs once per verified token.
* Self-Attention (SA): one causal block over the target's (frozen) embeddings of verified and
  drafted tokens, so the drafter knows what it has already drafted.
* Cross-Attention (CA): SA's outputs query the LSA memory, but only memory of tokens verified
  before the current draft began (plus a learned null slot). Nothing from the target beyond
  that point is needed, so training predicts whole segments of future tokens at once
  ("K-step bounded") — the way the drafter is used.
* Target Layer Inference (TLI=N): the drafter predicts the hidden state entering the target's
  last N layers; those frozen layers (attending to the target's KV of verified tokens plus local
  KV of drafted ones), the final norm and the LM head give the logits. TLI=0 predicts the final
  (normed) hidden state directly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from client.drafters.target_parts import DrafterModel, TargetParts
from client.drafters.tree_drafter import DraftNodes, TreeDrafter
from shared.engine.layers import Block, KVCache, RMSNorm
from shared.engine.linear import Linear
from shared.features import Features, split_kv
from shared.lookup import shared_length
from shared.lsa import LayerSelfAttention
from shared.tree import causal_from, causal_mask


@dataclass
class MoAConfig:
    tli: int
    num_layers: int  # of the target
    hidden_size: int  # E
    kv_width: int  # Ekv = 2·n_kv·d
    heads: int
    kv_heads: int
    head_dim: int
    mlp_hidden: int
    lsa_dim: int  # LSA width: Ekv squeezed to this before mixing the layers (the paper mixes at Ekv)
    lsa_heads: int
    lsa_mlp_hidden: int
    eps: float

    @classmethod
    def for_target(cls, parts: TargetParts, tli: int, lsa_dim: int = 128, mlp_hidden: int | None = None) -> MoAConfig:
        """Target-sized SA/CA (their MLP ``mlp_hidden`` wide, default the target's); a narrow LSA: it runs over every
        layer of every token (30x the tokens in training), and at Ekv wide it cost ~10x an EAGLE step on a CPU for
        little gain."""
        kv_width = 2 * parts.num_kv_heads * parts.head_dim
        heads = (parts.num_heads, parts.num_kv_heads, parts.head_dim, mlp_hidden or parts.mlp_hidden)
        lsa = (lsa_dim, max(1, lsa_dim // 64), 2 * lsa_dim)
        return cls(tli, parts.num_layers, parts.hidden_size, kv_width, *heads, *lsa, parts.eps)

    def to_dict(self) -> dict:
        return asdict(self)


class MoA(LayerSelfAttention, DrafterModel):
    """LSA (``shared.lsa``, so the server can run it too) + trainable SA/CA + frozen target parts;
    ``parts`` is excluded from saved weights."""

    kind = "moa"
    payload_forms = ("lsa", "kv")  # its memory made by the server's copy of its LSA, else every layer's KV

    def __init__(self, cfg: MoAConfig, parts: TargetParts):
        super().__init__(**LayerSelfAttention.dims(cfg.to_dict()))
        self.cfg = cfg
        E = cfg.hidden_size
        self.null_memory = nn.Parameter(torch.zeros(1, E))
        self.sa = Block(E, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.mlp_hidden, cfg.eps)
        self.ca = Block(E, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.mlp_hidden, cfg.eps, source_dim=E)
        self.out_norm = RMSNorm(E, cfg.eps)
        self.out = Linear(E, E)  # (ours: int8 with the rest of a drafter's own layers, ``quantize_drafter``)
        nn.init.normal_(self.null_memory, std=0.02)
        self.parts = parts

    # --- pieces shared by training and drafting ---

    def predict(self, sa_out: torch.Tensor, rope: tuple, memory_kv: tuple, mask: torch.Tensor) -> torch.Tensor:
        """CA over the memory, then the output map: the hidden state entering the target's last N layers."""
        return self.out(self.out_norm(self.ca(sa_out, mask, rope, memory=memory_kv)))

    def memory_kv(self, memory: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """CA keys/values of [B, M, E] memory at integer positions [B, M], with the null slot in front."""
        null = self.null_memory.expand(memory.shape[0], 1, -1).to(memory.dtype)
        memory = torch.cat([null, memory], dim=1)
        positions = torch.cat([positions[:, :1] * 0, positions], dim=1)
        return self.ca.memory_kv(memory, self.parts.rope(positions, memory.dtype))

    # --- training: whole sequences, segments of "future" tokens at once ---

    def forward_train(self, input_ids: torch.Tensor, kv: torch.Tensor, seg_start: torch.Tensor,
                      tli_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                      staircase: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """Predicted hidden states [B, T, E] (entering the target's last N layers) for every position.

        ``kv`` [B, T, L, Ekv] is the target's KV of every token; position t belongs to a draft
        that began at ``seg_start[b, t]`` (<= t): its CA sees memory of tokens before that only,
        and its TLI layers see the target's KV before it and the drafter's own KV from it on.
        ``staircase`` [B] bool: those sequences' SA sees only the position's own draft (from its
        start), not the tokens before it — the reference code's curriculum, which makes the
        drafter take the context from the target's memory (CA) rather than re-read it itself.
        """
        B, T = input_ids.shape
        positions = torch.arange(T, device=input_ids.device).expand(B, T)
        dtype = self.out_norm.weight.dtype
        rope = self.parts.rope(positions, dtype)
        sa_mask = causal_mask(T, input_ids.device)
        if staircase is not None:
            j = torch.arange(T, device=input_ids.device)
            own_draft = j[None, None, :] >= seg_start[:, :, None]  # [B, T, T]
            sa_mask = sa_mask & (own_draft | ~staircase[:, None, None])
        x = self.sa(self.parts.embed(input_ids).to(dtype), sa_mask, rope)
        memory = self.memory(kv.to(dtype))
        j = torch.arange(T, device=input_ids.device)
        sees = j[None, None, :] < seg_start[:, :, None]  # [B, T, T]: memory j visible to query t
        mask = torch.cat([torch.ones(B, T, 1, dtype=torch.bool, device=sees.device), sees], dim=2)
        return self.predict(x, rope, self.memory_kv(memory, positions), mask)

    def head_train(self, hidden: torch.Tensor, seg_start: torch.Tensor,
                   tli_kv: list[tuple[torch.Tensor, torch.Tensor]] | None) -> torch.Tensor:  # fmt: skip
        """Run predicted hidden states [B, T, E] through the TLI layers (teacher KV before each segment)."""
        if not self.parts.tli:
            return hidden
        B, T, _ = hidden.shape
        positions = torch.arange(T, device=hidden.device).expand(B, T)
        rope = self.parts.rope(positions, hidden.dtype)
        j = torch.arange(T, device=hidden.device)
        teacher = j[None, None, :] < seg_start[:, :, None]
        own = (j[None, None, :] >= seg_start[:, :, None]) & (j[None, None, :] <= j[None, :, None])
        mask = torch.cat([teacher, own], dim=2)  # keys: [teacher KV of T positions, own KV of T positions]
        x = hidden
        for layer, (tk, tv) in zip(self.parts.layers, tli_kv, strict=True):  # own KV written after the teacher's
            x = layer(x, mask, rope, KVCache.over(tk.to(x.dtype), tv.to(x.dtype)), at=T)
        return x

class MoADrafter(TreeDrafter):
    """Incremental MoA drafting: LSA once per verified token, SA/TLI caches rewound after each tree.

    Cache slots are positions for committed tokens; a tree's draft nodes take the slots after the
    root, in the order they were fed. The TLI caches hold the target's KV for positions below
    ``self.cached`` (sent with each verification) and the drafter's own KV from the root on.
    """

    def __init__(self, model: MoA, width: int = 4, depth: int = 5, name: str = "moa"):
        super().__init__(model, width, depth, name)

    def can_draft(self) -> bool:
        return self.mem_k is not None or bool(self.pending)

    kept = 0  # positions the next ``begin`` keeps (``keep_for``)

    def keep_for(self, prompt_ids: list[int]) -> int:
        self.kept = min(shared_length(prompt_ids, getattr(self, "tokens", ())), getattr(self, "cached", 0))
        return self.kept

    def begin(self, tokens: list[int], features: Features | None = None) -> None:
        kept, self.kept = self.kept, 0
        if kept and (features is None or len(features) == 0 or features.start == kept):
            # a conversation's next turn: its first ``kept`` positions as they are (SA and TLI cache slots, memory
            # entries), what follows fed again
            self._settle()
            self.tokens, self.fed = self.tokens[:kept], min(self.fed, kept)
            if self.cached > kept:
                self.cached = kept
                self.mem_k, self.mem_v = self.mem_k[:, :, : kept + 1], self.mem_v[:, :, : kept + 1]  # + the null slot
            self.nodes = DraftNodes(0, 0)
            self.absorb(tokens[kept:], features)
            return
        self.tokens: list[int] = []
        self.fed = 0  # committed tokens already in the SA cache
        self.cached = 0  # committed tokens whose target features arrived (all but the root)
        self.sa_cache = KVCache()
        self.tli_caches = [KVCache() for _ in self.model.parts.layers]
        self.mem_k = self.mem_v = None
        # features absorbed but not yet through LSA and into the TLI caches: done in one batch when the drafter
        # next drafts (while the policy has drafting paused, a round would otherwise pay LSA for one token: a large
        # share of a plain step on a fast CPU target)
        self.pending: list[Features] = []
        self.nodes = DraftNodes(0, 0)
        self.absorb(tokens, features)

    def absorb(self, tokens: list[int], features: Features | None = None) -> None:
        self.tokens += tokens
        if features is None or len(features) == 0:
            return
        if features.start != self.cached:
            raise ValueError(f"MoA needs features from position {self.cached}, got {features}")
        if features.memory is None and features.kv is None:
            raise ValueError(f"MoA needs kv or memory features, got {features}")
        if self.pending and _kinds(self.pending[-1]) != _kinds(features):
            self._settle()  # another payload form: the batch so far goes through first
        self.pending.append(features)
        self.cached = features.start + len(features)

    @torch.inference_mode()
    def _settle(self) -> None:
        """The pending features through LSA (their memory entries) and into the TLI caches, as one batch."""
        if not self.pending:
            return
        batch, self.pending = self.pending, []
        joined = {k: torch.cat([getattr(f, k) for f in batch]) if getattr(batch[0], k) is not None else None
                  for k in ("kv", "memory", "tli_kv")}  # fmt: skip
        features = Features(batch[0].start, kv=joined["kv"], memory=joined["memory"], tli_kv=joined["tli_kv"])
        m, N = self.model, self.model.parts.tli
        kv = None if features.kv is None else features.kv.to(self._device, self._dtype)
        if features.memory is not None:  # payload form lsa: the server ran our LSA
            memory = features.memory.to(self._device, self._dtype)
        else:
            memory = m.memory(kv)
        n = memory.shape[0]
        positions = torch.arange(features.start, features.start + n, device=self._device)[None]
        k, v = m.memory_kv(memory[None], positions)
        if self.mem_k is None:
            self.mem_k, self.mem_v = k, v
        else:  # drop the new null slot: it is already at the front
            self.mem_k = torch.cat([self.mem_k, k[:, :, 1:]], dim=2)
            self.mem_v = torch.cat([self.mem_v, v[:, :, 1:]], dim=2)
        if N:
            tli_kv = kv[:, m.parts.num_layers - N :] if features.tli_kv is None else features.tli_kv
            if tli_kv is None or tli_kv.shape[1] != N:
                raise ValueError(f"MoA TLI={N} needs the last {N} layers' KV, got {features}")
            keys, values = split_kv(tli_kv.to(self._device, self._dtype), m.parts.num_kv_heads)
            for cache, lk, lv in zip(self.tli_caches, keys, values, strict=True):
                cache.write(lk[None], lv[None], features.start)

    def rewind(self, n: int) -> None:
        if n <= 0:
            return
        self._settle()
        self.tokens = self.tokens[:-n]
        root = len(self.tokens) - 1
        self.fed = min(self.fed, root)
        if self.cached > root:
            self.cached = root
            self.mem_k, self.mem_v = self.mem_k[:, :, : root + 1], self.mem_v[:, :, : root + 1]

    # --- TreeScorer ---

    def _sa(self, tokens: list[int], positions: list[int], at: int, mask: torch.Tensor):
        """SA over new tokens written at cache slot ``at``: its outputs and their rotary (cos, sin)."""
        m = self.model
        ids = torch.tensor([tokens], device=self._device)
        rope = m.parts.rope(torch.tensor([positions], device=self._device), self._dtype)
        return m.sa(m.parts.embed(ids).to(self._dtype), mask, rope, self.sa_cache, at), rope

    def _logprobs(self, x: torch.Tensor, rope: tuple, at: int, mask: torch.Tensor) -> torch.Tensor:
        """CA over all memory, the TLI layers (own KV written at slot ``at``, seeing ``mask``), the LM head."""
        m = self.model
        mem_mask = torch.ones(1, x.shape[1], self.mem_k.shape[2], dtype=torch.bool, device=self._device)
        h = m.predict(x, rope, (self.mem_k, self.mem_v), mem_mask)
        for layer, cache in zip(m.parts.layers, self.tli_caches, strict=True):
            h = layer(h, mask, rope, cache, at)
        return torch.log_softmax(m.parts.logits(h)[0].float(), dim=-1)

    @torch.inference_mode()
    def root_logprobs(self) -> torch.Tensor:
        self._settle()
        root = len(self.tokens) - 1
        start = min(self.fed, root)  # the root again if nothing is pending (a second tree for the same root)
        pending = list(range(start, root + 1))
        x, rope = self._sa([self.tokens[p] for p in pending], pending, start, causal_from(start, len(pending),
                                                                                            self._device))  # fmt: skip
        self.fed = root + 1
        self.nodes = DraftNodes(root, root + 1)
        x, rope = x[:, -1:], (rope[0][:, -1:], rope[1][:, -1:])  # only the root drafts; the rest fill the SA cache
        sees_committed = torch.ones(1, 1, root + 1, dtype=torch.bool, device=self._device)
        return self._logprobs(x, rope, root, sees_committed)[0]

    @torch.inference_mode()
    def expand(self, tokens: list[int], parents: list[int]) -> torch.Tensor:
        positions, at, mask = self.nodes.add(parents, self._device)
        x, rope = self._sa(tokens, positions, at, mask)
        return self._logprobs(x, rope, at, mask)

    def end_tree(self) -> None:
        self.nodes = DraftNodes(len(self.tokens) - 1, len(self.tokens))


def _kinds(features: Features) -> tuple[bool, ...]:
    """Which tensors a features batch carries: batches that carry the same ones are joined before LSA."""
    return tuple(getattr(features, k) is not None for k in ("kv", "memory", "tli_kv"))
