"""Who may call the server: TLS (optionally mutual) and bearer tokens, and who a caller is.

A SplitSpec call without a token from ``--auth-token-file`` is refused UNAUTHENTICATED before it reaches
the service (tokens compared in constant time); health checks and reflection stay open, as load
balancers and operators expect. A caller's *identity* — its token's name, else its client
certificate's common name (mutual TLS), else "" — owns the sessions it opens: another caller
holding the id gets NOT_FOUND, as if the session did not exist.
"""

from __future__ import annotations

import hmac
from pathlib import Path

import grpc

from server.observability import SERVICE
from shared.auth import METADATA_KEY
from shared.errors import SplitspecError

STREAMING = {"FetchPayload", "Complete", "Generate"}  # the SplitSpec methods that answer with a stream
UNAUTHENTICATED = f"{METADATA_KEY} metadata with a valid bearer token is required (the server runs with auth)"


def server_credentials(cert: str | Path, key: str | Path, client_ca: str | Path | None = None):
    """TLS with this certificate and key; with ``client_ca``, clients must present a certificate it signed."""
    def read(path):
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise SplitspecError(f"cannot read {path}: {exc.strerror}") from None

    ca = read(client_ca) if client_ca else None
    return grpc.ssl_server_credentials([(read(key), read(cert))], root_certificates=ca,
                                       require_client_auth=ca is not None)  # fmt: skip


class TokenAuth(grpc.ServerInterceptor):
    """Refuses SplitSpec calls that present no known token (``tokens``: {token: identity})."""

    def __init__(self, tokens: dict[str, str]):
        self.tokens = [(token.encode(), name) for token, name in tokens.items()]

    def identity(self, metadata) -> str | None:
        """The name of the token in ``metadata`` (checked against every token, in constant time each), or None."""
        presented = next((v for k, v in metadata or () if k == METADATA_KEY), "")
        presented = presented.removeprefix("Bearer ").encode()
        found = None
        for token, name in self.tokens:
            if hmac.compare_digest(presented, token):
                found = name
        return found

    def intercept_service(self, continuation, details):
        prefix = f"/{SERVICE}/"
        if not details.method.startswith(prefix) or self.identity(details.invocation_metadata) is not None:
            return continuation(details)
        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED)

        if details.method.removeprefix(prefix) in STREAMING:
            return grpc.unary_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)


def caller(context, auth: TokenAuth | None) -> str:
    """Who is calling: the token's name, else the client certificate's common name, else ""."""
    if auth is not None:
        name = auth.identity(context.invocation_metadata())
        if name:
            return name
    names = context.auth_context().get("x509_common_name") or []
    return "cn:" + names[0].decode() if names else ""
