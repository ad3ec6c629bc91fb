"""The server's limits: declared once here; the command line flags and the Handshake reply follow by field name."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields


def limit(default, flag: str, help: str, off: bool = False):
    """A limit's default, its command-line flag and what it bounds; ``off``: 0 turns it off."""
    return field(default=default, metadata={"flag": flag, "help": help, "off": off})


@dataclass(frozen=True)
class ServerLimits:
    max_sessions: int = limit(16, "--max-sessions", "concurrent sessions")
    max_tree_nodes: int = limit(128, "--max-tree-nodes", "draft tree nodes per verification")
    max_context: int = limit(4096, "--max-context", "tokens per session, prompt included")
    max_new_tokens: int = limit(4096, "--max-new-tokens", "tokens per Complete call (the API baseline)")
    session_ttl_s: float = limit(600.0, "--session-ttl", "seconds an idle session is kept")
    max_probe_bytes: int = limit(16 * 1024 * 1024, "--max-probe-bytes", "reply bytes per Probe call")
    max_inline_payload_bytes: int = limit(1024 * 1024, "--max-inline-payload",
                                          "payload bytes carried inside a reply; more is streamed by FetchPayload")
    max_batch: int = limit(16, "--max-batch", "steps (trees, prompt pieces, decode steps) per target forward; "
                           "1: the serial server")
    max_batch_tokens: int = limit(512, "--max-batch-tokens", "tokens per target forward")
    batch_window_ms: float = limit(2.0, "--batch-window-ms", "how long a forward waits for more work once it has "
                                   "some (ms)")
    min_tree_nodes: int = limit(1, "--min-tree-nodes", "nodes of a tree always verified; beyond them the server "
                                "verifies the nodes worth their cost at its load (>= --max-tree-nodes: every node)")
    prefill_chunk: int = limit(256, "--prefill-chunk", "prompt tokens per forward: other sessions' calls run "
                               "between the pieces of a long prompt")
    kv_memory_mb: int = limit(4096, "--kv-memory-mb", "MiB of KV cache all sessions together may hold")
    keep_decoding: int = limit(64, "--keep-decoding", "tokens a Decode stream goes on decoding after its client left "
                               "mid-stream (a cut link): the client's next call takes them without compute")
    prefix_cache_mb: int = limit(1024, "--prefix-cache-mb", "MiB of KV the prefix cache keeps of finished "
                                 "sequences, so that a prompt starting with one (a conversation's next turn) prefills "
                                 "only the rest; 0: off", off=True)
    evict_idle_s: float = limit(1.0, "--evict-idle", "seconds a session must have been idle before it may be evicted "
                                "to admit a new one (its client reopens it from history)")

    @staticmethod
    def add_arguments(p: argparse.ArgumentParser) -> None:
        for f in fields(ServerLimits):
            p.add_argument(f.metadata["flag"], dest=f.name, type=type(f.default), default=f.default,
                           help=f"{f.metadata['help']} (default {f.default:g})")  # fmt: skip

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerLimits:
        """The limits the flags gave; ValueError naming the flag of one that is not positive."""
        for f in fields(cls):
            value = getattr(args, f.name)
            if value < 0 or (value == 0 and not f.metadata["off"]):
                raise ValueError(f"{f.metadata['flag']} must be > 0{' (or 0: off)' if f.metadata['off'] else ''}, "
                                 f"got {value}")
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}
