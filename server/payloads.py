"""What the server exports about cached tokens, and the LSAs it runs for clients (payload form ``lsa``).

Every payload is derived from state the session already holds — the KV cache (all layers, every
committed token but the root) and, for EAGLE-style clients, the final hidden states kept beside
it — so any range can be exported again later: that is how a long prefill is streamed in chunks
and how a payload the client could not decode is sent once more.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc

from server.refusals import Abort
from shared import payload
from shared.bundles import SHIPPED, find_bundle
from shared.errors import SplitspecError
from shared.features import cache_kv
from shared.lsa import LayerSelfAttention, load_lsa, weights_digest
from shared.payload import PayloadSpec
from shared.wire import splitspec_pb2 as pb

DRAFTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class LSARegistry:
    """LSAs of drafter bundles by name, loaded once (and checked against the target) on first request."""

    def __init__(self, target, bundle_dirs: tuple[Path, ...] = (SHIPPED,)):
        self.target = target
        self.bundle_dirs = tuple(Path(d) for d in bundle_dirs)
        self._loaded: dict[str, tuple[LayerSelfAttention, str]] = {}
        self._lock = threading.Lock()

    def load(self, name: str, digest: str = "") -> LayerSelfAttention:
        """The LSA of bundle ``name``; ValueError if ``name`` cannot be a bundle's folder name (checked before the
        file system sees it), SplitspecError if there is no such MoA bundle, it does not fit the target, or its
        weights differ from the client's (``digest``)."""
        if not DRAFTER_NAME.fullmatch(name):
            shown = repr(name) if len(name) <= 64 else f"of {len(name)} characters"
            raise ValueError(f"drafter name {shown} must be a bundle's folder name (letters, digits, '.', '_', '-'; "
                             "at most 64 characters), like 'moa-tli1'")  # fmt: skip
        with self._lock:
            if name not in self._loaded:
                path = find_bundle(name, self.bundle_dirs, self.target.fingerprint)
                inside = path is not None and any(path.resolve().is_relative_to(d.resolve()) for d in self.bundle_dirs)
                if not inside:
                    where = ", ".join(str(d) for d in self.bundle_dirs)
                    raise SplitspecError(f"the server has no drafter bundle {name!r} (looked in {where})")
                lsa, _ = load_lsa(path, self.target)
                self._loaded[name] = (lsa, weights_digest(path))
            lsa, ours = self._loaded[name]
        if digest and digest != ours:
            raise SplitspecError(
                f"the server's bundle {name!r} has weights {ours}, the client's has {digest}: "
                "both sides must hold the same bundle for payload form 'lsa'"
            )
        return lsa

    def preload(self) -> list[str]:
        """Load the LSA of every MoA bundle in the bundle folders that fits the target (the others are skipped): where
        replicas share the sessions (``serve --ray``), the one that answers a Handshake naming a drafter may not be
        the one its sessions open on. Returns the names loaded."""
        names = sorted({p.name for d in self.bundle_dirs if d.is_dir() for p in d.iterdir() if p.is_dir()})
        loaded = []
        for name in names:
            try:
                self.load(name)
                loaded.append(name)
            except (SplitspecError, ValueError):
                pass  # not a MoA bundle, or not one for this target
        return loaded

    def get(self, name: str) -> LayerSelfAttention | None:
        with self._lock:
            entry = self._loaded.get(name)
        return entry[0] if entry else None


class Unavailable(Exception):
    """A well-formed payload request this server or session cannot serve (yet)."""


def check_spec(spec: PayloadSpec, target, lsas: LSARegistry, has_hidden: bool) -> None:
    """ValueError for a spec that is wrong for this target, Unavailable for one this session cannot serve."""
    if spec.tli_layers > target.num_layers:
        raise ValueError(f"tli_layers {spec.tli_layers} exceeds the target's {target.num_layers} layers")
    if spec.form == "lsa" and lsas.get(spec.drafter) is None:
        raise Unavailable(f"drafter {spec.drafter!r} was not named at Handshake: the server has not loaded its LSA")
    if "hidden" in payload.feature_kinds(spec) and not has_hidden:
        raise Unavailable("this session was opened without payload form 'hidden'; its hidden states were not kept")


def export(session, spec: PayloadSpec, lsas: LSARegistry, start: int, end: int) -> pb.Payload:
    """Encode the features of cached tokens [start, end) as ``spec`` asks."""
    if not spec:
        return pb.Payload(start=start, count=0)
    kv = cache_kv(session.sequence.cache, start, end).float()
    hidden = session.hidden[start:end].float() if session.hidden is not None else None
    tensors = payload.tensors_for(spec, kv, hidden, lsas.get(spec.drafter) if spec.form == "lsa" else None)
    return payload.encode(start, tensors, spec.precision)  # the codec converts to float32 itself


def raw_bytes_per_token(spec: PayloadSpec, target) -> int:
    """Raw fp32 bytes of one token's payload, however it will be encoded: sizes FetchPayload's chunks."""
    kv_width = 2 * target.num_kv_heads * target.head_dim
    fp32 = PayloadSpec(spec.form, "fp32", spec.tli_layers, spec.drafter)
    return int(payload.raw_bytes_per_token(fp32, target.num_layers, kv_width, target.hidden_size))


def fetched(session, spec: PayloadSpec, lsas: LSARegistry, start: int, end: int, chunk: int, context,
            lock: Callable) -> Iterator[pb.Payload]:
    """FetchPayload's stream: the features of cached tokens [start, end) in ``chunk``-token messages, each exported
    under the session's lock (``lock(session)`` takes it); it stops when the client is gone."""
    for a in range(start, end, chunk):
        if not context.is_active():
            return
        b = min(a + chunk, end)
        lock(session)
        try:
            if b > session.sequence.cached_len:  # the session was rolled back meanwhile (a stop token, a failure)
                raise Abort(grpc.StatusCode.ABORTED,
                            f"the session now caches {session.sequence.cached_len} tokens: payload range "
                            f"[{start}, {end}) was cut short by a rollback at token {a}")  # fmt: skip
            msg = export(session, spec, lsas, a, b)
        finally:
            session.lock.release()
        yield msg
