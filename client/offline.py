"""Generating without the server, and making peace with it afterwards.

When the link is down the drafter itself is the model: its most likely next token (for MoA with
TLI>0, through the target's own last layers) is committed unverified, one at a time, through the
ordinary drafter interface (``propose(1, depth=1)`` then ``absorb``) — no drafter-specific code.
When the link is back, ``reconcile_verify`` has the server verify those tokens as one chain (in
chunks of the server's tree limit): the client keeps the accepted prefix, takes the server's token
at the first divergence and drops the rest, so a greedy run ends exactly as an uninterrupted one.
"""

from __future__ import annotations

import torch

from client.drafters.base import Drafter
from shared.acceptance import SamplingParams, target_probs
from shared.tree import DraftTree


def local_token(drafter: Drafter, sampling: SamplingParams = SamplingParams(),
                generator: torch.Generator | None = None, width: int = 8) -> int | None:  # fmt: skip
    """The drafter's own next token, committed (unverified); None if it has nothing to offer.

    Greedy: its most likely token. Sampling: a draw, at the requested temperature and top-p, among
    the first level of its tree (at most ``width`` tokens, the drafter's own top-B): a truncated
    version of its distribution, which a tree drafter does not expose whole.
    """
    if sampling.temperature == 0:
        tree = drafter.propose(1, 1)
        token = tree.tokens[0] if tree.tokens else None
    else:
        tree = drafter.propose(width, 1)
        token = _draw(tree, sampling, generator)
    if token is not None:
        drafter.absorb([token])
    return token


def _draw(tree: DraftTree, sampling: SamplingParams, generator: torch.Generator | None) -> int | None:
    roots = [i for i, p in enumerate(tree.parents) if p == -1]
    if not roots:
        return None
    if not tree.scores:  # no probabilities (prompt lookup): its one candidate
        return tree.tokens[roots[0]]
    probs = target_probs(torch.tensor([tree.scores[i] for i in roots]), sampling)  # the target's own rule
    return tree.tokens[roots[torch.multinomial(probs, 1, generator=generator).item()]]


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
