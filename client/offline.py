"""Generating without the server, and making peace with it afterwards.

When the link is down the drafter itself is the model: its most likely next token (for MoA with
TLI>0, through the target's own last layers) is committed unverified, one at a time, through the
ordinary drafter interface (``propose(1, depth=1)`` then ``absorb``) — no drafter-specific code.
When the link is back, ``reconcile_verify`` has the server verify those tokens as one chain (in
chunks of the server's tree limit): the client keeps the accepted prefix, takes the server's token
at the first divergence and drops the rest, so a greedy run ends exactly as an uninterrupted one.
"""

from __future__ import annotations

from client.drafters.base import Drafter
from shared.tree import DraftTree


def local_token(drafter: Drafter) -> int | None:
    """The drafter's own next token, committed (unverified); None if it has nothing to offer."""
    tree = drafter.propose(1, 1)
    if not tree.tokens:
        return None
    drafter.absorb([tree.tokens[0]])
    return tree.tokens[0]


def reconcile_verify(verifier, drafter: Drafter, local: list[int], max_nodes: int) -> list[int]:
    """Verify the unverified tail ``local`` (already absorbed by ``drafter``); return what replaces it.

    The result is the longest prefix of ``local`` the target agrees with, then the target's own
    token where it first disagrees (or its token after the last local one, when a chunk ended
    there; when the last local token came back as the target's own choice, nothing is added).
    The drafter is rewound and fed
    the target's features along the way, so it continues exactly as after an ordinary round.
    """
    out: list[int] = []
    i = 0  # next local token not yet verified
    while i < len(local):
        chunk = local[i : i + max(1, max_nodes)]
        result = verifier.verify(DraftTree.chain(chunk))
        accepted, bonus = len(result.accepted), result.new_tokens[-1]
        out += chunk[:accepted]
        i += accepted
        if i < len(local) and local[i] == bonus:  # the target picks the next local token too: go on from it
            drafter.absorb([], result.features)
            out.append(bonus)
            i += 1
            continue
        drafter.rewind(len(local) - i)
        drafter.absorb([bonus], result.features)
        out.append(bonus)
        return out
    return out
