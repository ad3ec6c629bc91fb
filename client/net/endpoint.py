"""How the client reaches a server: its address, TLS (server roots, optionally a client certificate for
mutual TLS) and the bearer token presented on every call. Every connection the client makes (the
calls, the heartbeat's, the reconnection polls') is opened from one ``Endpoint``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from shared.auth import METADATA_KEY, read_token
from shared.errors import SplitspecError


@dataclass(frozen=True)
class Endpoint:
    address: str
    tls: bool = False  # TLS with the system's roots unless ``ca`` is given
    ca: bytes | None = None  # PEM roots that must have signed the server's certificate
    cert: bytes | None = None  # PEM client certificate and key, for mutual TLS
    key: bytes | None = None
    token: str | None = None

    @classmethod
    def from_files(cls, address: str, tls: bool = False, ca=None, cert=None, key=None, token_file=None) -> Endpoint:
        """From the CLI's files (``--tls-ca``, ``--tls-cert``, ``--tls-key``, ``--auth-token-file``)."""
        if (cert is None) != (key is None):
            raise SplitspecError("--tls-cert and --tls-key go together (a client certificate and its key)")

        def read(path):
            try:
                return None if path is None else Path(path).read_bytes()
            except OSError as exc:
                raise SplitspecError(f"cannot read {path}: {exc.strerror}") from None

        return cls(address, tls or any(p is not None for p in (ca, cert)), read(ca), read(cert), read(key),
                   None if token_file is None else read_token(token_file))  # fmt: skip

    def channel(self, options: list | None = None) -> grpc.Channel:
        """A new channel (its own connection when ``options`` ask for a local subchannel pool)."""
        options = list(options or [])
        if self.tls:
            credentials = grpc.ssl_channel_credentials(self.ca, self.key, self.cert)
            channel = grpc.secure_channel(self.address, credentials, options=options)
        else:
            channel = grpc.insecure_channel(self.address, options=options)
        if self.token is None:
            return channel
        return grpc.intercept_channel(channel, _Bearer(self.token))


class _Bearer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds ``authorization: Bearer <token>`` to every call's metadata."""

    def __init__(self, token: str):
        self.metadata = (METADATA_KEY, f"Bearer {token}")

    def _details(self, details):
        metadata = [*(details.metadata or []), self.metadata]
        return _Details(details.method, details.timeout, metadata, details.credentials, details.wait_for_ready,
                        details.compression)  # fmt: skip

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)


@dataclass(frozen=True)
class _Details(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: list
    credentials: object
    wait_for_ready: bool | None
    compression: object
