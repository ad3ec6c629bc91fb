"""Bearer tokens, as both sides read them: the server's ``--auth-token-file`` lists who may call, the client's
names the one token it presents (in the ``authorization`` call metadata, ``Bearer <token>``)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from shared.errors import SplitspecError

METADATA_KEY = "authorization"
MIN_TOKEN_CHARS = 16


def read_tokens(path: str | Path) -> dict[str, str]:
    """{token: identity} from a file of lines ``TOKEN`` or ``NAME TOKEN`` (``#`` comments, blank lines skipped).

    A token without a name is known by a digest of it (never the token itself: identities get logged)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise SplitspecError(f"cannot read the token file {path}: {exc.strerror}") from None
    tokens: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) > 2:
            raise SplitspecError(f"{path}:{number}: expected TOKEN or NAME TOKEN, got {len(fields)} fields")
        token = fields[-1]
        if len(token) < MIN_TOKEN_CHARS:
            raise SplitspecError(f"{path}:{number}: a token of {len(token)} characters is too easy to guess; "
                                 f"use at least {MIN_TOKEN_CHARS} (e.g. `openssl rand -hex 32`)")  # fmt: skip
        tokens[token] = fields[0] if len(fields) == 2 else "token-" + hashlib.sha256(token.encode()).hexdigest()[:8]
    if not tokens:
        raise SplitspecError(f"the token file {path} lists no token")
    return tokens


def read_token(path: str | Path) -> str:
    """The one token a client presents: the first in the file."""
    return next(iter(read_tokens(path)))
