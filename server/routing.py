"""Strict session affinity for `splitspec serve --ray`: a Ray Serve request router (Serve's extension point).

Serve's default router treats a multiplexed id as a hint. Until the controller has told the routers
that a replica registered a key (tens to hundreds of ms after the OpenSession that registered it), a
call carrying it goes to whichever replicas hold the fewest keys: a session's first Verify often
lands beside its session, and the client must reopen it (measured by ``make bench-scale``). This
router needs no news from the controller: a key goes to the replica known to hold it, else to the
replica it hashes to among the live ones (rendezvous hashing), which is where its OpenSession went.
A replica's death or a new replica moves only the keys hashed to it, and a key already held stays
with its holder. Calls without a key (Handshake, Probe, Complete) take the less loaded of two.

Imported by Serve's proxy and by handles (``request_router_class``), never by ``splitspec serve``.
"""

from __future__ import annotations

import hashlib
import random

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica


def rank(key: str, replica_id: str) -> bytes:
    """Replica ``replica_id``'s draw for ``key`` (Serve's unique id of the replica): the highest draw takes the key
    (rendezvous hashing)."""
    return hashlib.blake2b(f"{key}/{replica_id}".encode(), digest_size=8).digest()


def owner(key: str, replica_ids: list[str]) -> str:
    """Which of ``replica_ids`` a key no replica holds yet goes to."""
    return max(replica_ids, key=lambda r: rank(key, r))


class SessionRouter(RequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:  # fmt: skip
        if not candidate_replicas:
            return []
        key = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        if key:
            holders = [r for r in candidate_replicas if key in r.multiplexed_model_ids]
            return [holders or [max(candidate_replicas, key=lambda r: rank(key, r.replica_id.unique_id))]]
        return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
