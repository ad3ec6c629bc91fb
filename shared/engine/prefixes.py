"""The prefix cache: the KV of sequences finished on a target, kept under a byte budget, so that a new session whose
prompt starts with one of them (the next turn of a conversation, a shared system prompt, a reopened session)
prefills only the rest. The server keeps one (``server.service``), and so does the in-process verifier of
``--local`` (``client.verifiers.LocalVerifier``).

Apps send the whole conversation again with every request and no conversation id, so prefixes are matched on
tokens: each entry is indexed by the chained hashes of its blocks of ``BLOCK`` tokens, a prompt finds the entry that
holds its longest run of whole blocks, and the match then runs on token by token. An entry is a whole sequence (its
tokens and the KV of all but its newest), not shared blocks: a conversation's next turn extends its last one, so the
new entry replaces the entry it extends, and nothing is held twice for the common case. Least recently used entries
go first when the budget is full.

A prefix is shared only within one owner (on a server, the caller's identity: the auth token's; without tokens
every caller is the same one). Reused KV are the very values a cold prefill would compute only where a row's result
does not depend on the rows beside it (``Target.rows_independent``: the low-bit kernels, exact bf16); elsewhere the
cache is off, so that fp32 output stays transformers' own.
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass, field

import torch

from shared.lookup import shared_length

BLOCK = 32  # tokens a hashed block holds: a prompt shorter than this never reuses
MIN_TOKENS = BLOCK  # a reuse shorter than this is not worth the copy


def block_hashes(tokens: list[int] | tuple[int, ...]) -> list[bytes]:
    """The chained hash of each whole block of ``tokens``: hash i covers tokens [0, (i + 1) * BLOCK)."""
    out, h = [], b""
    for i in range(len(tokens) // BLOCK):
        block = tokens[i * BLOCK : (i + 1) * BLOCK]
        h = hashlib.blake2b(h + b"".join(t.to_bytes(4, "little") for t in block), digest_size=16).digest()
        out.append(h)
    return out


def host(t: torch.Tensor) -> torch.Tensor:
    """A copy in the host's memory: the cache never takes a GPU's memory from the sessions (a reuse copies it back,
    a few ms for a long conversation)."""
    return t.to("cpu", copy=True)


def common_length(cached, prompt: list[int]) -> int:
    """How many first tokens ``cached`` and ``prompt`` share, at most all but the prompt's last."""
    return min(shared_length(cached, prompt), len(prompt) - 1)


@dataclass
class Prefix:
    """One finished sequence: ``tokens`` (all of them) and the KV of the first ``len(k)`` along positions."""

    owner: str
    tokens: tuple[int, ...]
    k: torch.Tensor  # [layers, 1, kv_heads, cached, head_dim]
    v: torch.Tensor
    hidden: torch.Tensor | None  # [cached, E] final hidden states, where the session kept them
    used: float = field(default_factory=time.monotonic)
    hashes: list[bytes] = field(default_factory=list)  # ``block_hashes(tokens[:cached])``

    @property
    def cached(self) -> int:
        return self.k.shape[3]

    @property
    def nbytes(self) -> int:
        extra = 0 if self.hidden is None else self.hidden.numel() * self.hidden.element_size()
        return 2 * self.k.numel() * self.k.element_size() + extra


@dataclass
class Reuse:
    """What a new session takes: the first ``length`` tokens' KV (and hidden states, when asked)."""

    length: int
    k: torch.Tensor
    v: torch.Tensor
    hidden: torch.Tensor | None


class PrefixCache:
    """Finished sequences by owner, indexed by block hashes, in host memory; thread-safe. ``max_bytes`` 0 turns it
    off."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: dict[int, Prefix] = {}
        self._index: dict[tuple[str, bytes], int] = {}  # (owner, chained hash) -> entry key
        self._next = 0
        self._bytes = 0  # the entries' bytes, kept as they come and go
        self._lock = threading.Lock()
        self.hit_tokens = self.miss_tokens = self.evictions = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, owner: str, tokens: list[int], k: torch.Tensor, v: torch.Tensor,
            hidden: torch.Tensor | None = None) -> bool:  # fmt: skip
        """Keep a finished sequence: ``tokens`` and the KV of its first ``k.shape[3]`` tokens (copied here). An entry
        it extends is dropped. False where it is too short or alone bigger than the budget."""
        cached = k.shape[3]
        if cached < MIN_TOKENS or not self.max_bytes:
            return False
        entry = Prefix(owner, tuple(tokens[:cached]), host(k[:, :, :, :cached]), host(v[:, :, :, :cached]),
                       None if hidden is None else host(hidden[:cached]))  # fmt: skip
        if entry.nbytes > self.max_bytes:
            return False
        entry.hashes = hashes = block_hashes(entry.tokens)
        with self._lock:
            for key in {self._index.get((owner, h)) for h in hashes} - {None}:
                old = self._entries[key]
                if old.tokens == entry.tokens[: len(old.tokens)]:  # extended (or repeated): the new one holds it all
                    self._drop(key)
            key, self._next = self._next, self._next + 1
            self._entries[key] = entry
            self._bytes += entry.nbytes
            for h in hashes:
                self._index[(owner, h)] = key  # the newest entry holding a block answers for it
            while self._bytes > self.max_bytes:
                self._drop(min(self._entries, key=lambda k: self._entries[k].used))
                self.evictions += 1
        return True

    def keep(self, owner: str, sequence, hidden: torch.Tensor | None = None) -> bool:
        """``put`` a finished ``TargetSession``: its tokens and the KV it holds (``hidden``: its kept states)."""
        n = sequence.cached_len
        return self.put(owner, sequence.tokens, sequence.cache.k[:, :, :, :n], sequence.cache.v[:, :, :, :n], hidden)

    def take(self, owner: str, prompt: list[int], hidden: bool = False, live=()) -> Reuse | None:
        """The longest cached run of ``prompt``'s first tokens, at most all but its last (whose state the prefill
        must compute to pick the next token), of ``owner``'s finished sequences or of ``live`` sessions (the server's
        ``Session``s of that owner: a conversation's next turn may come before the last one's close); counted as hit
        and miss tokens."""
        reuse = self._find(owner, prompt, hidden) if self.max_bytes else None
        for session in live if self.max_bytes else ():
            if (hidden and session.hidden is None) or not session.lock.acquire(blocking=False):
                continue
            try:  # held, so no call moves its cache meanwhile
                sequence = session.sequence
                n = common_length(sequence.tokens[: sequence.cached_len], prompt)
                if n >= max(MIN_TOKENS, reuse.length if reuse else 0):
                    cache = sequence.cache
                    reuse = Reuse(n, host(cache.k[:, :, :, :n]), host(cache.v[:, :, :, :n]),
                                  host(session.hidden[:n]) if hidden else None)  # fmt: skip
            finally:
                session.lock.release()
        with self._lock:
            self.hit_tokens += reuse.length if reuse else 0
            self.miss_tokens += len(prompt) - (reuse.length if reuse else 0)
        return reuse

    def _find(self, owner: str, prompt: list[int], hidden: bool) -> Reuse | None:
        limit = len(prompt) - 1
        with self._lock:
            entry = None
            for h in block_hashes(prompt[:limit]):
                key = self._index.get((owner, h))
                if key is None:
                    break
                entry = self._entries[key]
            if entry is None or (hidden and entry.hidden is None):
                return None
            n = common_length(entry.tokens, prompt)  # the hashes found the entry; the tokens decide
            if n < MIN_TOKENS:
                return None
            entry.used = time.monotonic()
            return Reuse(n, entry.k[:, :, :, :n], entry.v[:, :, :, :n],
                         entry.hidden[:n] if hidden and entry.hidden is not None else None)  # fmt: skip

    def _drop(self, key: int) -> None:
        """Forget an entry; a block it answered for passes to the newest other entry of its owner holding it."""
        entry = self._entries.pop(key)
        self._bytes -= entry.nbytes
        for h in entry.hashes:
            if self._index.get((entry.owner, h)) == key:
                heirs = [k for k, e in self._entries.items() if e.owner == entry.owner and h in e.hashes]
                if heirs:
                    self._index[(entry.owner, h)] = max(heirs)
                else:
                    del self._index[(entry.owner, h)]
