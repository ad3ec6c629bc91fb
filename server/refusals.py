"""How the server refuses a request: an ``Abort`` carries the gRPC status, a message that names the bad value and what
was expected, and for RESOURCE_EXHAUSTED when to retry. ``shown`` quotes a client's value safely in that message."""

from __future__ import annotations

import grpc

from shared.channel import PUSHBACK

MAX_DETAILS = 1000  # characters of a status message: far below gRPC's 16 KiB metadata limit
SHOWN = 80  # characters of a client's string echoed in a message


def shown(value) -> str:
    """A client's value as a message may quote it: repr, cut to ``SHOWN`` characters."""
    text = repr(value)
    return text if len(text) <= SHOWN else f"{text[: SHOWN - 20]}...({len(text)} characters)"


class Abort(Exception):
    """A request the server refuses: carries the gRPC status code, a message naming the problem and, for
    RESOURCE_EXHAUSTED, how long to wait before retrying (``grpc-retry-pushback-ms``)."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_s: float | None = None):
        super().__init__(message)
        self.code, self.retry_s = code, retry_s

    def send(self, context) -> None:
        if self.retry_s is not None:
            context.set_trailing_metadata(((PUSHBACK, str(int(1000 * self.retry_s))),))
        context.abort(self.code, str(self)[:MAX_DETAILS])
