"""The server's session store: bounded in count, idle sessions expire after a TTL."""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field

import torch

from shared.target import TargetSession


class StoreFull(Exception):
    pass


@dataclass
class Session:
    id: str
    engine: TargetSession
    lock: threading.Lock = field(default_factory=threading.Lock)
    last_used: float = field(default_factory=time.monotonic)
    hidden: torch.Tensor | None = None  # [cached, E] final hidden states, kept for payload mode "hidden"

    def keep_hidden(self, verdict) -> None:
        if self.hidden is not None and verdict.features is not None and verdict.features.hidden is not None:
            self.hidden = torch.cat([self.hidden[: verdict.features.start], verdict.features.hidden])

    def truncate(self, length: int) -> None:
        """Back to ``length`` committed tokens: the client re-sends a round whose reply it never received."""
        self.engine.truncate(length)
        if self.hidden is not None:
            self.hidden = self.hidden[: self.engine.cached_len]


class SessionStore:
    """Holds each session's KV cache; thread-safe; evicts sessions idle longer than ``ttl_s``."""

    def __init__(self, max_sessions: int, ttl_s: float):
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._sessions)

    def reserve(self) -> None:
        """Fail fast, before any compute, when a new session could not be stored."""
        with self._lock:
            self._evict_idle()
            if len(self._sessions) >= self.max_sessions:
                raise StoreFull(f"all {self.max_sessions} sessions are in use; close one or retry later")

    def add(self, engine: TargetSession) -> Session:
        with self._lock:
            self._evict_idle()
            if len(self._sessions) >= self.max_sessions:
                raise StoreFull(f"all {self.max_sessions} sessions are in use; close one or retry later")
            session = Session(secrets.token_hex(8), engine)
            self._sessions[session.id] = session
            return session

    def get(self, session_id: str) -> Session | None:
        with self._lock:
            self._evict_idle()
            session = self._sessions.get(session_id)
            if session is not None:
                session.last_used = time.monotonic()
            return session

    def pop(self, session_id: str) -> Session | None:
        with self._lock:
            return self._sessions.pop(session_id, None)

    def _evict_idle(self) -> None:
        now = time.monotonic()
        for sid in [s.id for s in self._sessions.values() if now - s.last_used > self.ttl_s and not s.lock.locked()]:
            del self._sessions[sid]
