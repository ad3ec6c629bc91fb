"""The server's session store: admission against a count and a KV-memory budget, eviction, reaping.

A session holds one sequence's KV cache (``shared.engine.target.TargetSession``; it grows with the
sequence). A new session is admitted when a place is free in count and memory; otherwise the
sessions idle longest (none of their calls running, idle at least ``evict_idle_s``) are evicted
to make room — their clients reopen from the history they hold — and only when that is not
enough is the request refused (``StoreFull``, with how long to wait). A place is *held* from
admission until the session is added or the prefill fails, so concurrent opens cannot all pass
admission and be refused after their prefill. Sessions idle past the TTL are reaped by a thread
on time, not on the next request. The streaming API's decodes take places too (``hold``), so
open streams count against the same limits as sessions.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from dataclasses import dataclass, field

import torch

from shared.engine.target import TargetSession


class StoreFull(Exception):
    """No place for a new session; ``retry_s``: when one is likely to be free (an idle one expiring)."""

    def __init__(self, message: str, retry_s: float):
        super().__init__(message)
        self.retry_s = retry_s


@dataclass
class SessionStats:
    """What a session did, for its log line when it ends."""

    prompt_tokens: int = 0
    reused_tokens: int = 0  # of them, taken from the prefix cache
    rounds: int = 0
    nodes: int = 0  # draft nodes verified
    accepted: int = 0
    decoded: int = 0  # tokens the server decoded by itself (Decode)
    verify_s: float = 0.0
    payload_bytes: int = 0
    opened: float = field(default_factory=time.monotonic)


@dataclass
class Session:
    id: str
    sequence: TargetSession  # the target's state of this sequence: its KV cache, tokens and sampling
    owner: str = ""  # who opened it (the authenticated identity; "" without auth)
    stats: SessionStats = field(default_factory=SessionStats)
    lock: threading.Lock = field(default_factory=threading.Lock)
    last_used: float = field(default_factory=time.monotonic)
    hidden: torch.Tensor | None = None  # [cached, E] final hidden states, kept for payload form "hidden"
    # told (under ``lock``) when a call that may have committed tokens lets go: a chained Verify that came in ahead of
    # the round it follows waits on it
    changed: threading.Condition = field(init=False)
    # (the length it verified after, the length it left) of the last call, if a Verify: the round a chained Verify
    # follows, which tokens alike in number and value left otherwise (a cancelled stream's, decoded past what its
    # client took) must not stand in for
    verified: tuple[int, int] | None = None
    # set while a call waits for ``lock``: a Decode stream whose client left and that decodes on for it stops at its
    # next token (the client is back and asks for something else)
    wanted: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.changed = threading.Condition(self.lock)

    def acquire(self, timeout_s: float) -> bool:
        """Take ``lock`` within ``timeout_s`` seconds (False if another call holds it on), telling a stream that decodes
        on for a client that left to stop."""
        self.wanted.set()
        if not self.lock.acquire(timeout=timeout_s):
            return False
        self.wanted.clear()
        return True

    def release(self) -> None:
        """Let go of ``lock`` after a call that may have changed the sequence, waking a chained call waiting for it."""
        self.changed.notify_all()
        self.lock.release()

    def keep_hidden(self, verdict) -> None:
        if self.hidden is not None and verdict.features is not None and verdict.features.hidden is not None:
            self.hidden = torch.cat([self.hidden[: verdict.features.start], verdict.features.hidden])

    def truncate(self, length: int) -> None:
        """Back to ``length`` committed tokens: the client re-sends a round whose reply it never received."""
        self.sequence.truncate(length)
        if self.hidden is not None:
            self.hidden = self.hidden[: self.sequence.cached_len]

    @property
    def nbytes(self) -> int:
        hidden = 0 if self.hidden is None else self.hidden.numel() * self.hidden.element_size()
        return self.sequence.cache.nbytes + hidden


class SessionStore:
    """Sessions by id; thread-safe; see the module docstring for admission, eviction and reaping."""

    def __init__(self, max_sessions: int, ttl_s: float, max_bytes: int | None = None, evict_idle_s: float = 1.0,
                 on_end=None):  # fmt: skip
        """``on_end(session, reason)`` is told of every session that ends (closed, evicted, expired, failed)."""
        self.max_sessions, self.ttl_s, self.max_bytes, self.evict_idle_s = max_sessions, ttl_s, max_bytes, evict_idle_s
        self.on_end = on_end or (lambda session, reason: None)
        self._sessions: dict[str, Session] = {}
        self._held: dict[int, int] = {}  # places held for sessions being opened (or streams): bytes each
        self._next_hold = 0
        self._lock = threading.Lock()
        self.evicted = self.expired = 0
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, daemon=True, name="splitspec-reaper")
        self._reaper.start()

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def nbytes(self) -> int:
        """KV memory of the sessions (their caches as allocated now) plus the places held."""
        with self._lock:
            return self._bytes()

    def _bytes(self) -> int:
        return sum(s.nbytes for s in self._sessions.values()) + sum(self._held.values())

    def free_bytes(self) -> int:
        """What the KV-memory budget has left (the caller holds the lock, or reads a moment's figure)."""
        return max(0, (self.max_bytes or 0) - self._bytes())

    @contextlib.contextmanager
    def hold(self, nbytes: int):
        """Hold a place of ``nbytes`` for as long as the block runs (a session being opened, a stream)."""
        with self._lock:
            self._admit(nbytes)
            key, self._next_hold = self._next_hold, self._next_hold + 1
            self._held[key] = nbytes
        try:
            yield
        finally:
            with self._lock:
                del self._held[key]

    def _admit(self, nbytes: int) -> None:
        """Make room for one more place of ``nbytes``, evicting the longest-idle sessions; else StoreFull."""
        self._expire()
        now = time.monotonic()
        idle = sorted((s for s in self._sessions.values() if not s.lock.locked()
                       and now - s.last_used >= self.evict_idle_s), key=lambda s: s.last_used)  # fmt: skip

        def fits() -> bool:
            count = len(self._sessions) + len(self._held) < self.max_sessions
            return count and (self.max_bytes is None or self._bytes() + nbytes <= self.max_bytes)

        while not fits() and idle:
            self.on_end(self._sessions.pop(idle.pop(0).id), "evicted")
            self.evicted += 1
        if fits():
            return
        busy = [s for s in self._sessions.values() if s.lock.locked() or now - s.last_used < self.evict_idle_s]
        retry = min((self.evict_idle_s - (now - s.last_used) for s in busy), default=self.evict_idle_s)
        what = f"all {self.max_sessions} sessions are in use"
        if len(self._sessions) + len(self._held) < self.max_sessions:
            what = (f"a session asks for {nbytes / 2**20:.1f} MiB of KV cache and {self.free_bytes() / 2**20:.1f} "
                    f"MiB of the budget of {self.max_bytes / 2**20:.0f} MiB are free")  # fmt: skip
        raise StoreFull(f"{what} and none is idle; retry in {max(retry, 0.05):.2f}s", max(retry, 0.05))

    def add(self, sequence: TargetSession, owner: str = "") -> Session:
        """Store a session opened under a ``hold`` (its place then passes to it)."""
        with self._lock:
            session = Session(secrets.token_hex(16), sequence, owner)
            self._sessions[session.id] = session
            return session

    def get(self, session_id: str, owner: str = "") -> Session | None:
        """The session, if it exists and ``owner`` opened it (another client's id is as good as unknown)."""
        with self._lock:
            self._expire()
            session = self._sessions.get(session_id)
            if session is None or session.owner != owner:
                return None
            session.last_used = time.monotonic()
            return session

    def idle(self, owner: str) -> list[Session]:
        """``owner``'s sessions that no call holds now (a snapshot: one may be taken a moment later)."""
        with self._lock:
            return [s for s in self._sessions.values() if s.owner == owner and not s.lock.locked()]

    def holds(self, session_id: str) -> bool:
        """Does the store hold session ``session_id`` (whoever owns it)? For routing figures, not for access."""
        with self._lock:
            return session_id in self._sessions

    def pop(self, session_id: str, owner: str | None = None, reason: str = "closed") -> Session | None:
        """Remove and return the session (only ``owner``'s, when given)."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None or (owner is not None and session.owner != owner):
                return None
            self.on_end(self._sessions.pop(session_id), reason)
            return session

    def close(self) -> None:
        self._stop.set()
        self._reaper.join(timeout=5)

    def _expire(self) -> None:
        now = time.monotonic()
        for sid in [s.id for s in self._sessions.values() if now - s.last_used > self.ttl_s and not s.lock.locked()]:
            self.on_end(self._sessions.pop(sid), "expired")
            self.expired += 1

    def _reap(self) -> None:
        while not self._stop.wait(min(max(self.ttl_s / 4, 0.05), 1.0)):
            with self._lock:
                self._expire()
