"""The target model engine: one KV cache per sequence, trees verified in one forward pass.

Used by the server and by the client's single-device (``--local``) path alike, so both verify
with the same mask, positions, cache bookkeeping and acceptance rule.

Cache invariant: the cache holds every committed token except the newest, the *root*. A
verification feeds [root, drafted nodes...] with an ancestor mask, keeps the KV of the root and
the accepted path, and the bonus token becomes the next root.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from shared.acceptance import SamplingParams, accept_tree
from shared.features import Features, cache_kv
from shared.tree import DraftTree, tree_attention_mask, tree_positions


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of the vocabulary (added tokens included): equal exactly when token ids mean the same.

    Which tokens a tokenizer calls "special" is left out on purpose: transformers 5.17 and 5.23 read
    the same GGUF into the same 49,152 ids but disagree on that list (and on EOS), which made bundles
    trained on one machine refuse to load on the other. End-of-turn ids travel in the handshake.
    """
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    blob = json.dumps(vocab, ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


class Target:
    """A loaded causal LM plus the facts about it that both sides of the wire need."""

    def __init__(self, model, tokenizer=None, name: str = "", max_context: int | None = None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name or getattr(model.config, "name_or_path", "") or model.config.model_type
        cfg = model.config
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.num_layers = cfg.num_hidden_layers
        self.hidden_size = cfg.hidden_size
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        limit = getattr(cfg, "max_position_embeddings", None) or 2048
        self.max_context = min(limit, max_context) if max_context else limit
        self.eos_token_ids = _eos_ids(model, tokenizer)
        self.fingerprint = tokenizer_fingerprint(tokenizer) if tokenizer is not None else ""

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def session(self, sampling: SamplingParams = SamplingParams(), features=()) -> TargetSession:
        """A new sequence; ``features`` names what each prefill/verify reports about newly cached tokens."""
        return TargetSession(self, sampling, features=Features.check_kinds(features))


def _eos_ids(model, tokenizer) -> list[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


@dataclass
class Verdict:
    """Outcome of one verification: accepted node indices, the bonus token, and compute time."""

    accepted: list[int]
    bonus: int
    new_tokens: list[int]
    compute_s: float
    features: Features | None = None  # about the tokens this call added to the cache


@dataclass
class TargetSession:
    """One sequence on the target: its committed tokens, KV cache and random stream."""

    target: Target
    sampling: SamplingParams
    tokens: list[int] = field(default_factory=list)
    features: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        self.cache = DynamicCache(config=self.target.model.config)
        self.generator = torch.Generator().manual_seed(self.sampling.seed)

    @property
    def cached_len(self) -> int:
        return self.cache.get_seq_length()

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int]) -> Verdict:
        """Run the prompt, pick the first token; afterwards the cache holds the whole prompt."""
        if self.tokens:
            raise RuntimeError("prefill called twice on one session")
        if not prompt_ids:
            raise ValueError("empty prompt: expected at least one token")
        if len(prompt_ids) + 1 > self.target.max_context:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens does not fit the context of {self.target.max_context}"
            )
        start = time.perf_counter()
        ids = torch.tensor([prompt_ids], device=self.target.device)
        out = self.target.model(
            input_ids=ids,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
            output_hidden_states="hidden" in self.features,
        )
        _, first = accept_tree([], [], out.logits[0, -1:], self.sampling, self.generator)
        self.tokens = list(prompt_ids) + [first]
        rows = list(range(len(prompt_ids)))
        return Verdict([], first, [first], time.perf_counter() - start, self._features(0, out, rows))

    @torch.inference_mode()
    def verify(self, tree: DraftTree) -> Verdict:
        """Score root + tree in one forward pass, accept a path, keep only its KV."""
        if not self.tokens:
            raise RuntimeError("verify before prefill")
        prefix = self.cached_len
        n = len(tree)
        if prefix + n + 1 > self.target.max_context:
            raise ValueError(
                f"tree of {n} nodes after {prefix + 1} tokens exceeds the context of {self.target.max_context}"
            )
        start = time.perf_counter()
        dev, dtype = self.target.device, self.target.dtype
        ids = torch.tensor([[self.tokens[-1], *tree.tokens]], device=dev)
        positions = torch.tensor([tree_positions(tree.parents, prefix)], device=dev)
        mask = None if _is_chain(tree.parents) else tree_attention_mask(tree.parents, prefix, dtype, dev)
        out = self.target.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            output_hidden_states="hidden" in self.features,
        )
        accepted, bonus = accept_tree(tree.tokens, tree.parents, out.logits[0], self.sampling, self.generator)
        self._keep(prefix, accepted)
        new = [tree.tokens[i] for i in accepted] + [bonus]
        self.tokens.extend(new)
        features = self._features(prefix, out, [0] + [1 + i for i in accepted])
        return Verdict(accepted, bonus, new, time.perf_counter() - start, features)

    def _features(self, start: int, out, rows: list[int]) -> Features | None:
        """Features of the tokens now cached at [start, start + len(rows)); ``rows`` index the forward's output."""
        if not self.features:
            return None
        end = start + len(rows)
        kv = cache_kv(self.cache, start, end).clone() if "kv" in self.features else None
        hidden = out.hidden_states[-1][0, rows].clone() if "hidden" in self.features else None
        return Features(start, kv=kv, hidden=hidden)

    def _keep(self, prefix: int, accepted: list[int]) -> None:
        """Move the accepted nodes' KV right after the root and drop the rest of the tree."""
        src = [prefix + 1 + i for i in accepted]
        dst = list(range(prefix + 1, prefix + 1 + len(accepted)))
        if src != dst:
            src_t = torch.tensor(src, device=self.target.device)
            for layer in self.cache.layers:
                layer.keys[:, :, dst[0] : dst[-1] + 1] = layer.keys.index_select(2, src_t)
                layer.values[:, :, dst[0] : dst[-1] + 1] = layer.values.index_select(2, src_t)
        self._crop_to(prefix + 1 + len(accepted))

    def _crop_to(self, length: int) -> None:
        extra = self.cached_len - length
        if extra > 0:
            self.cache.crop(-extra)  # transformers 5.x crops by a negative count

    def truncate(self, length: int) -> None:
        """Forget committed tokens beyond ``length`` (the last kept one becomes the root)."""
        if not 1 <= length <= len(self.tokens):
            raise ValueError(f"cannot truncate {len(self.tokens)} tokens to {length}")
        self.tokens = self.tokens[:length]
        self._crop_to(length - 1)


def _is_chain(parents: list[int]) -> bool:
    """A chain needs no custom mask: the model's own causal mask is exact for it."""
    return all(p == i - 1 for i, p in enumerate(parents))
