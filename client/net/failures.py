"""What a failed gRPC call means to the client: the link is down (``LinkDown``), the server lost the session
(``SessionLost``), the server is full and said when to try again (``ServerFull``), or another error."""

from __future__ import annotations

import re

import grpc

from shared.channel import PUSHBACK
from shared.errors import SplitspecError


class LinkDown(SplitspecError):
    """The server could not be reached, or did not answer in time: the link (or the server) is down."""


class SessionLost(SplitspecError):
    """The server no longer holds this session as the client knows it: expired, lost in a restart, or out
    of step (a request whose reply the link lost had already changed it)."""


class Stale(SplitspecError):
    """A chained round whose assumption failed: the round before it committed other tokens than it assumed, so the
    server verified nothing and changed nothing."""


LINK_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}


class ServerFull(SplitspecError):
    """The server has no place for another session now (RESOURCE_EXHAUSTED) and said when to try again."""

    def __init__(self, message: str, retry_s: float):
        super().__init__(message)
        self.retry_s = retry_s


def retry_hint_s(exc: grpc.RpcError) -> float | None:
    """The wait a refusing server asked for (``grpc-retry-pushback-ms`` in the trailing metadata, or at the end of the
    message as ``[grpc-retry-pushback-ms=N]`` where a proxy passes no trailing metadata: Ray Serve's), if it named
    one."""
    trailing = getattr(exc, "trailing_metadata", None)
    value = dict(trailing() or ()).get(PUSHBACK) if trailing else None
    if value is None and (found := re.search(rf"\[{PUSHBACK}=(-?\d+)\]$", exc.details() or "")):
        value = found.group(1)
    try:
        ms = int(value) if value is not None else -1
    except ValueError:
        return None
    return ms / 1000 if ms >= 0 else None  # a negative pushback says: do not retry


def rpc_error(address: str, exc: grpc.RpcError) -> SplitspecError:
    """The SplitspecError (or LinkDown / SessionLost / ServerFull) for a failed call."""
    message = f"server {address}: {exc.code().name}: {exc.details()}"
    retry_s = retry_hint_s(exc) if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else None
    if retry_s is not None:
        return ServerFull(message, retry_s)
    # INTERNAL: the server failed the call: a splitspec server drops a session whose call failed (its cache may be
    # half-written), and Ray Serve's proxy answers INTERNAL for a call whose replica died: the session is gone either
    # way, and reopening it from history is the way on (client.loop.offline bounds how often that is tried)
    lost = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ABORTED, grpc.StatusCode.INTERNAL)
    kind = LinkDown if exc.code() in LINK_CODES else SessionLost if exc.code() in lost else None
    return (kind or SplitspecError)(message)
