"""The target model engine: one preallocated KV cache per sequence, trees verified in one forward pass.

Used by the server and by the client's single-device (``--local``) path alike, so both verify
with the same mask, positions, cache bookkeeping and acceptance rule. The forward is our own
(``shared.engine.decoder``); transformers' model is loaded only on request, as the reference to check
against (``Target.reference_model``).

Cache invariant: the cache holds every committed token except the newest, the *root*. A
verification writes [root, drafted nodes...] after the cached prefix with an ancestor mask,
moves the KV of the accepted path into place right after the root and sets the length; the
bonus token becomes the next root. Rolling back is setting the length.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shared.acceptance import SamplingParams, accept_tree, argmax, argmaxes
from shared.engine.decoder import Part, Transformer
from shared.engine.kernels import cpu_label
from shared.engine.linear import Linear
from shared.features import Features, cache_kv
from shared.tree import DraftTree, causal_from, tree_mask, tree_positions

INITIAL_CAPACITY = 256  # a session's KV cache starts this long and doubles as needed (up to max_context)


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
    """A loaded decoder (``shared.engine.decoder.Transformer``) plus the facts about it that both sides of the wire
    need."""

    def __init__(self, engine: Transformer, tokenizer=None, name: str = "", max_context: int | None = None,
                 path: str | Path | None = None, eos_token_ids: list[int] | None = None):  # fmt: skip
        self.engine = engine.eval()
        self.tokenizer = tokenizer
        self.path = path
        cfg = engine.cfg
        self.name = name or cfg.model_type
        self.vocab_size = cfg.vocab_size
        self.num_layers = cfg.num_layers
        self.hidden_size = cfg.hidden_size
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.max_context = min(cfg.max_positions, max_context) if max_context else cfg.max_positions
        ids = set(eos_token_ids or ())
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        self.eos_token_ids = sorted(ids)
        self.fingerprint = tokenizer_fingerprint(tokenizer) if tokenizer is not None else ""
        self._reference = None
        # (seconds a forward costs, seconds each token adds) as this machine's path timing measured them
        # (``shared.engine.paths.Table.costs``); None where not measured (CUDA, a model loaded by other means)
        self.costs: tuple[float, float] | None = None

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def dtype(self) -> torch.dtype:
        return self.engine.dtype

    @property
    def weights(self) -> str:
        """``int8`` or ``int4`` when the projections run on splitspec's CPU kernels, else ``native``."""
        if self.engine.lm_head.qweight is None:
            return "native"
        kinds = {m.weights_kind() for m in self.engine.layers.modules() if isinstance(m, Linear)}
        return kinds.pop() if len(kinds) == 1 else "+".join(sorted(kinds))

    @property
    def rows_independent(self) -> bool:
        """Is a token's state the same whatever rows share its forward? On splitspec's kernels and in exact bf16, yes;
        fp32 on torch's GEMMs no (a row's rounding follows the row count): there the KV of a prefix computed before
        would not be what a cold prefill computes, so the server does not reuse it."""
        return self.weights != "native" or (self.dtype == torch.bfloat16 and self.engine.exact)

    def describe(self) -> str:
        """What computes this target, for start-up lines and benchmark tables: device, CPU, precision, kernels."""
        dtype = str(self.dtype).removeprefix("torch.")
        if self.device.type != "cpu":
            return f"{self.device}, {dtype}" + (", CUDA graphs" if self.engine.graphs is not None else "")
        if self.weights != "native":
            build = self.engine.lm_head.kernel_build
            head = self.engine.lm_head.weights_kind()
            return (f"cpu ({cpu_label()}), {self.weights} weights (LM head {head}) and int8 activations on "
                    f"{build} kernels, {dtype} between")  # fmt: skip
        return f"cpu ({cpu_label()}), {dtype}"

    def session(self, sampling: SamplingParams = SamplingParams(), feature_kinds=()) -> TargetSession:
        """A new sequence; ``feature_kinds`` names what each prefill/verify reports about newly cached tokens."""
        return TargetSession(self, sampling, feature_kinds=Features.check_kinds(feature_kinds))

    def reference_model(self):
        """transformers' own model of the same folder, in the same dtype (loaded once, on first use): the
        reference that tests and benchmarks check the engine against. Never on a serving path."""
        if self._reference is None:
            from transformers import AutoModelForCausalLM

            if self.path is None:
                raise ValueError("this target was not loaded from a folder: it has no reference model")
            model = AutoModelForCausalLM.from_pretrained(self.path, dtype=self.dtype, attn_implementation="sdpa")
            self._reference = model.to(self.device).eval()
        return self._reference


@dataclass
class Verdict:
    """What the target made of one call, in process or across the wire: a verification (the accepted node indices,
    then the new tokens: their tokens and the bonus), or a prefill or a streamed step (no nodes, one new token)."""

    accepted: list[int]
    new_tokens: list[int]
    compute_s: float = 0.0  # the target's time on it (the server's, across the wire)
    features: Features | None = None  # about the tokens this call added to the cache
    verified_nodes: int | None = None  # tree nodes verified: a loaded server may verify only the first of those sent
    load: object | None = None  # the server's costs now (a ``Load`` message; None in process)

    @property
    def bonus(self) -> int:
        """The target's own token after the accepted path (the prefill's first token)."""
        return self.new_tokens[-1]


@dataclass
class Step:
    """One forward's worth of a session's work: ``part`` goes through the engine (alone, or in one forward
    with other sessions' parts), then ``finish(hidden, logits)`` turns its hidden states into the call's result.
    ``logits``: the LM head's rows for ``hidden[head]``, computed with other steps' (``head_logits``); None:
    ``finish`` computes them itself."""

    part: Part
    finish: Callable[[torch.Tensor, torch.Tensor | None], object]
    nodes: int = 0  # a verification's tree nodes
    cut: Callable[[int], Step] | None = None  # a verification of the tree's first k nodes instead
    head: list[int] = field(default_factory=list)  # hidden rows whose logits finish needs first


def head_logits(engine: Transformer, steps: list[Step], hidden: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Each step's ``head`` rows of the LM head, from one matmul for all: the head is a forward's biggest weight, and
    a batch of many sequences would otherwise read it once each (its rows do not depend on which rows share the
    call, as ``forward_many``'s). None for a step with no such rows, or whose hidden states are missing."""
    wanted = [i for i, (s, h) in enumerate(zip(steps, hidden, strict=True)) if s.head and h is not None]
    out: list[torch.Tensor | None] = [None] * len(steps)
    if not wanted:
        return out
    logits = engine.logits(torch.cat([hidden[i][steps[i].head] for i in wanted]))
    for i, part in zip(wanted, logits.split([len(steps[i].head) for i in wanted]), strict=True):
        out[i] = part
    return out


@dataclass
class TargetSession:
    """One sequence on the target: its committed tokens, KV cache and random stream."""

    target: Target
    sampling: SamplingParams
    tokens: list[int] = field(default_factory=list)
    feature_kinds: frozenset[str] = frozenset()  # what each call reports (Features): "kv", "hidden"

    def __post_init__(self) -> None:
        self.cache = self.target.engine.new_cache(INITIAL_CAPACITY)  # grown as the sequence does
        self.cached_len = 0  # cache slots [0, cached_len) hold committed tokens: all but the root
        self.generator = torch.Generator().manual_seed(self.sampling.seed)

    def _part(self, ids: list[int], positions: list[int], mask: torch.Tensor | None) -> Part:
        """``ids`` at ``positions``, to be written at slot ``cached_len`` (the cache grown to hold them)."""
        self.cache.reserve(self.cached_len + len(ids), self.target.max_context)
        return Part(ids, positions, mask, self.cache, self.cached_len)

    def run(self, step: Step):
        """Run a step alone (a server batches steps of many sessions instead: ``server.batching``)."""
        with torch.inference_mode():
            return step.finish(self.target.engine.forward_many([step.part])[0], None)

    def reuse(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Take the KV of the prompt's first ``k.shape[3]`` tokens from a sequence computed before (the server's prefix
        cache); ``prefill`` then computes only the rest. The same values a cold prefill gives where
        ``Target.rows_independent``."""
        if self.tokens or self.cached_len:
            raise RuntimeError("reuse after prefill: a prefix is taken before the prompt runs")
        n = k.shape[3]
        self.cache.reserve(n, self.target.max_context)
        self.cache.k[:, :, :, :n] = k
        self.cache.v[:, :, :, :n] = v
        self.cached_len = n

    def prefill(self, prompt_ids: list[int], chunk: int | None = None, run: Callable[[Step], object] | None = None
                ) -> Verdict:  # fmt: skip
        """Run the prompt, pick the first token; afterwards the cache holds the whole prompt.

        ``chunk``: at most that many tokens per forward; ``run`` runs each piece (default: alone, now). In
        bf16 on a CPU (exact mode) the result is bit-identical to one forward; in fp32 the last bits of the
        prompt's states may differ (MKL's GEMM rows depend on the row count), as between any two batch shapes.
        After ``reuse`` only the tokens past the reused ones run, and the features start there.
        """
        if self.tokens:
            raise RuntimeError("prefill called twice on one session")
        if self.cached_len >= len(prompt_ids):
            raise ValueError(f"a reused prefix of {self.cached_len} tokens leaves nothing of a {len(prompt_ids)}-token "
                             "prompt to run: expected at most all but its last token")  # fmt: skip
        if not prompt_ids:
            raise ValueError("empty prompt: expected at least one token")
        if len(prompt_ids) + 1 > self.target.max_context:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens does not fit the context of {self.target.max_context}"
            )
        run = run or self.run
        start = time.perf_counter()
        n, first_run = len(prompt_ids), self.cached_len
        step = max(1, chunk or n)
        pieces = []
        for a in range(first_run, n, step):
            b = min(a + step, n)
            part = self._part(list(prompt_ids[a:b]), list(range(a, b)), causal_from(a, b - a, self.target.device))
            pieces.append(run(Step(part, lambda hidden, _, b=b: self._filled(b, hidden))))
        with torch.inference_mode():
            hidden = torch.cat(pieces)
            logits = self.target.engine.logits(hidden[-1:])
            _, first = accept_tree([], [], logits, self.sampling, self.generator)
            self.tokens = list(prompt_ids) + [first]
            return Verdict([], [first], time.perf_counter() - start, self._features(first_run, hidden))

    def _filled(self, end: int, hidden: torch.Tensor) -> torch.Tensor:
        self.cached_len = end  # a prompt piece is committed as soon as it is cached: the next goes after it
        return hidden

    def verify(self, tree: DraftTree, run: Callable[[Step], object] | None = None) -> Verdict:
        """Score root + tree in one forward pass, accept a path, keep only its KV (``run``: as in ``prefill``)."""
        return (run or self.run)(self.verify_step(tree))

    def verify_step(self, tree: DraftTree) -> Step:
        """``verify`` as a step: its forward's part, and what to do with the hidden states."""
        if not self.tokens:
            raise RuntimeError("verify before prefill")
        prefix = self.cached_len
        n = len(tree)
        if prefix + n + 1 > self.target.max_context:
            raise ValueError(
                f"tree of {n} nodes after {prefix + 1} tokens exceeds the context of {self.target.max_context}"
            )
        start = time.perf_counter()
        dev = self.target.device
        if n == 0:
            mask = None  # one token sees the whole prefix
        elif _is_chain(tree.parents):
            mask = causal_from(prefix, n + 1, dev)
        else:
            mask = tree_mask(tree.parents, prefix, dev)
        part = self._part([self.tokens[-1], *tree.tokens], tree_positions(tree.parents, prefix), mask)
        rows = TreeLogits.first_rows(tree)

        def finish(hidden: torch.Tensor, first: torch.Tensor | None) -> Verdict:
            logits = TreeLogits(self.target.engine, hidden, rows, first)
            accepted, bonus = accept_tree(tree.tokens, tree.parents, logits, self.sampling, self.generator)
            kept = [1 + i for i in accepted]
            self.cache.move([prefix + r for r in kept], list(range(prefix + 1, prefix + 1 + len(kept))))
            self.cached_len = prefix + 1 + len(kept)
            new = [tree.tokens[i] for i in accepted] + [bonus]
            self.tokens.extend(new)
            features = self._features(prefix, hidden[[0, *kept]]) if self.feature_kinds else None
            return Verdict(accepted, new, time.perf_counter() - start, features, verified_nodes=n)

        return Step(part, finish, n, lambda k: self.verify_step(tree.head(k)), rows)

    def decode_step(self) -> Step:
        """A plain decoding step whose token is picked afterwards, by ``pick``: a batched generator (self-distillation)
        multiplies every sequence's state by the LM head in one GEMM instead of streaming the head once per sequence."""
        if not self.tokens:
            raise RuntimeError("decode before prefill")
        if self.cached_len + 2 > self.target.max_context:
            raise ValueError(f"{self.cached_len + 1} tokens fill the context of {self.target.max_context}")
        return Step(self._part([self.tokens[-1]], [self.cached_len], None), lambda hidden, _: hidden)

    def pick(self, logits: torch.Tensor) -> int:
        """Commit the next token, chosen from the logits [1, V] of a ``decode_step``'s state by the session's rule."""
        _, token = accept_tree([], [], logits, self.sampling, self.generator)
        self.cached_len += 1
        self.tokens.append(token)
        return token

    def _features(self, start: int, hidden: torch.Tensor) -> Features | None:
        """Features of the tokens now cached at [start, start + len(hidden)); ``hidden`` are their final states."""
        if not self.feature_kinds:
            return None
        end = start + hidden.shape[0]
        kv = cache_kv(self.cache, start, end).clone() if "kv" in self.feature_kinds else None
        return Features(start, kv=kv, hidden=hidden.clone() if "hidden" in self.feature_kinds else None)

    def truncate(self, length: int) -> None:
        """Forget committed tokens beyond ``length`` (the last kept one becomes the root)."""
        if not 1 <= length <= len(self.tokens):
            raise ValueError(f"cannot truncate {len(self.tokens)} tokens to {length}")
        self.tokens = self.tokens[:length]
        self.cached_len = min(self.cached_len, length - 1)


class TreeLogits:
    """A verified tree's logits, row by row as the acceptance walk reaches them (row 0: the root, i + 1: node i).

    One matmul gives the rows of the root, of every node with children and of the leaf the drafter ranks likeliest
    (``chain_of_firsts``); any other leaf's only if the walk ends on it. Most of a wide tree's nodes are leaves and
    the LM head is a forward's biggest matmul, while a walk that takes the whole likeliest path (most rounds of a
    small tree) would otherwise stream the head a second time for one row. Row results do not depend on which rows
    are computed together (one GEMM per row set).
    """

    def __init__(self, engine: Transformer, hidden: torch.Tensor, rows: list[int], first: torch.Tensor | None = None):
        """``rows``: ``first_rows`` of the tree; ``first``: their logits where computed already (``head_logits``)."""
        self.engine, self.hidden = engine, hidden
        self.first = engine.logits(hidden[rows]) if first is None else first
        self.index = {r: i for i, r in enumerate(rows)}  # a row of ``first``
        self.more: dict[int, torch.Tensor] = {}  # rows computed on demand
        self.best: dict[int, int] | None = None  # the first rows' argmaxes, read at once off a GPU

    @staticmethod
    def first_rows(tree: DraftTree) -> list[int]:
        """The rows the first matmul computes: the root, every node with children, the likeliest leaf."""
        likeliest = tree.chain_of_firsts()[-1:]  # its leaf; none for an empty tree
        return sorted({0} | {p + 1 for p in tree.parents} | {i + 1 for i in likeliest})

    def __getitem__(self, row: int) -> torch.Tensor:
        if row in self.index:
            return self.first[self.index[row]]
        if row not in self.more:
            self.more[row] = self.engine.logits(self.hidden[row : row + 1])[0]
        return self.more[row]

    def greedy(self, row: int) -> int:
        """The row's argmax (``accept_tree``'s greedy walk). On a GPU the first rows' are read in one transfer: a walk
        that read each row's would wait on the GPU once a row, a batched server's forward a hundred times and more."""
        if self.first.device.type == "cpu" or row not in self.index:
            return argmax(self[row])
        if self.best is None:
            self.best = dict(zip(self.index, argmaxes(self.first), strict=True))
        return self.best[row]


def _is_chain(parents: list[int]) -> bool:
    """A chain is causal after the prefix: no tree mask to build."""
    return all(p == i - 1 for i, p in enumerate(parents))
