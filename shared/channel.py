"""gRPC channel settings the server and its clients must agree on, in one place.

A payload (a long prompt's KV) can be tens of MB: far past gRPC's 4 MB default message limit, so both
ends raise it to the same ``MAX_MESSAGE_BYTES``. A client's channels also reconnect on our schedule.
"""

from __future__ import annotations

import hashlib
import secrets
import threading

MAX_MESSAGE_BYTES = 64 * 1024 * 1024

# the largest message either end sends or accepts (server and client alike)
MESSAGE_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]

# a client's channels: gRPC's own reconnection backoff grows to 2 minutes; ours (client.loop.offline) polls on its own
# schedule, so the channel must be ready to try again within a fraction of a second
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]

# where a refusing server says how long to wait before retrying (gRPC's own name for it): trailing metadata, and
# at the end of the message where a proxy passes no trailing metadata with an error (Ray Serve's)
PUSHBACK = "grpc-retry-pushback-ms"

# the call metadata naming a session's route key, sent on every call of that session (and on a Complete call);
# `splitspec serve --ray` routes by it (Ray Serve's multiplexed model id), one server process ignores it
ROUTE_KEY = "multiplexed_model_id"
CONVERSATION_TOKENS = 64  # a prompt's first tokens that name its conversation on a cluster (``route_key``)


def route_key(prompt_ids: list[int]) -> str:
    """The route key of a session opened with ``prompt_ids``: its conversation's, a hash of the prompt's first
    ``CONVERSATION_TOKENS`` tokens, so that the next turn (which begins alike) reaches the replica that holds its
    prefix; random for a shorter prompt. Sessions sharing a key share a replica, which is what a shared prefix wants."""
    if len(prompt_ids) < CONVERSATION_TOKENS:
        return secrets.token_hex(8)
    head = b"".join(int(t).to_bytes(4, "little") for t in prompt_ids[:CONVERSATION_TOKENS])
    return "c" + hashlib.blake2b(head, digest_size=8).hexdigest()



def off_thread(action, name: str = "splitspec-close") -> None:
    """Run ``action()`` on a daemon thread of its own and return at once: for gRPC housekeeping nobody should wait
    for. ``grpc.Channel.close`` waits for the channel's calls and connectivity watches to wind down and has been seen
    to block for good (grpc/grpc#20026; a client reconnecting after a replica died, on a slow CPU), and a call's
    ``cancel`` takes the same locks: a reconnection, a probe or the end of a generation must not wait behind them. A
    thread each, so one that never returns holds nothing else up."""
    threading.Thread(target=action, daemon=True, name=name).start()


def close_soon(channel) -> None:
    """Close ``channel`` off the caller's thread (``off_thread``)."""
    off_thread(channel.close)
