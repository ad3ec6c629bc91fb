"""The decode loop: draft a tree, have it verified, commit what was kept, repeat.

It knows nothing about which drafter proposes or where verification happens; both are
interfaces. Stats follow the MoA/EAGLE papers: acceptance length is the mean number of tokens
gained per verification round (accepted drafts + the bonus token).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

from client.drafters.base import Drafter
from shared.acceptance import SamplingParams


@dataclass
class GenerationStats:
    new_tokens: int = 0
    wall_s: float = 0.0
    tokens_per_s: float = 0.0
    rounds: int = 0
    server_calls: int = 0
    acceptance_length: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    payload_bytes: int = 0  # encoded feature payloads among bytes_received
    prefill_payload_bytes: int = 0  # the prompt's share of payload_bytes
    bytes_up_per_round: float = 0.0  # a round: one server call that verifies (or prefills)
    bytes_down_per_round: float = 0.0
    bytes_down_per_token: float = 0.0  # per generated token
    payload_bytes_per_token: float = 0.0  # payloads of the rounds (not the prompt's) per generated token
    server_compute_s: float = 0.0
    ttft_s: float = 0.0
    draft_s: float = 0.0
    rtt_ms: float | None = None  # the link as the client saw it at the end (None: no link, or not measured yet)
    bandwidth_mbps: float | None = None  # downlink, Mbit/s
    uplink_mbps: float | None = None

    def as_dict(self) -> dict:
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(self).items()}


@dataclass
class Generation:
    token_ids: list[int]
    finish_reason: str  # "stop" (an EOS token), "length" (max_new_tokens) or "context" (window full)
    stats: GenerationStats


def _finish(tokens: list[int], new: list[int], stop: set[int], limit: int) -> tuple[list[int], str]:
    """Cut ``new`` at the first stop token (kept) or at the token budget."""
    room = limit - len(tokens)
    for i, t in enumerate(new[:room]):
        if t in stop:
            return new[: i + 1], "stop"
    return new[:room], ("length" if len(new) >= room else "")


def speculative_generate(
    verifier,
    drafter: Drafter,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    stop_ids: list[int] | None = None,
    max_tree_nodes: int = 64,
    on_tokens: Callable[[list[int]], None] | None = None,
    policy=None,
) -> Generation:
    """Generate up to ``max_new_tokens`` with ``drafter`` proposing and ``verifier`` deciding.

    With a ``policy`` (``client.adaptive.AdaptivePolicy``) each round's tree is drafted to the
    policy's depth, cut to the size it expects to pay off, and the payload is the one it picks.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    stop = set(verifier.eos_token_ids if stop_ids is None else stop_ids)
    stats = GenerationStats()
    before = replace(verifier.counters)
    start = time.perf_counter()
    emit = on_tokens or (lambda tokens: None)
    opened = verifier.open(list(prompt_ids), sampling, drafter.features)
    stats.ttft_s = time.perf_counter() - start
    out, reason = _finish([], opened.new_tokens, stop, max_new_tokens)
    emit(out)
    drafter.begin(list(prompt_ids) + out, opened.features)
    gained = 0
    try:
        while not reason:
            room = verifier.max_context - len(prompt_ids) - len(out)
            if room < 1:
                reason = "context"
                break
            t0 = time.perf_counter()
            budget = min(max_tree_nodes, verifier.max_tree_nodes, room - 1)
            depth = policy.depth if policy is not None else None
            tree = drafter.propose(budget, depth)
            draft_s = time.perf_counter() - t0
            stats.draft_s += draft_s
            if policy is not None:
                spec = policy.payload(1.0 + (policy.history[-1].expected_gain if policy.history else 1.0))
                if spec is not None:
                    verifier.payload = spec
                per_token = policy.bytes_per_token(verifier.payload) if policy.bytes_per_token else 0.0
                tree = policy.cut(tree, per_token)
            result = verifier.verify(tree)
            if policy is not None:
                policy.observe(tree, len(result.accepted), result.compute_s, draft_s, depth or 0)
            stats.rounds += 1
            gained += len(result.new_tokens)
            drafter.absorb(result.new_tokens, result.features)
            new, reason = _finish(out, result.new_tokens, stop, max_new_tokens)
            out += new
            emit(new)
    finally:
        verifier.close()
    stats.wall_s = time.perf_counter() - start
    stats.new_tokens = len(out)
    stats.tokens_per_s = len(out) / stats.wall_s
    stats.acceptance_length = gained / stats.rounds if stats.rounds else 0.0
    copy_link_stats(stats, verifier, before)
    return Generation(out, reason, stats)


def api_generate(
    remote,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    stop_ids: list[int] | None = None,
    on_tokens: Callable[[list[int]], None] | None = None,
) -> Generation:
    """The API baseline: the server decodes alone and streams tokens; no drafts, one call."""
    stop = list(remote.eos_token_ids if stop_ids is None else stop_ids)
    stats = GenerationStats()
    before = replace(remote.counters)
    start = time.perf_counter()
    out: list[int] = []
    reason = "length"
    for tokens in remote.stream(list(prompt_ids), sampling, max_new_tokens, stop):
        if not out:
            stats.ttft_s = time.perf_counter() - start
        out += tokens
        if on_tokens:
            on_tokens(tokens)
        if tokens and tokens[-1] in stop:
            reason = "stop"
    stats.wall_s = time.perf_counter() - start
    stats.new_tokens = len(out)
    stats.tokens_per_s = len(out) / stats.wall_s
    stats.rounds = len(out)
    stats.acceptance_length = 1.0
    copy_link_stats(stats, remote, before)
    return Generation(out, reason, stats)


def copy_link_stats(stats: GenerationStats, verifier, before) -> None:
    """What this generation cost the link (counters since ``before``) and the verifier's latest link estimates."""
    counters = verifier.counters.since(before)
    stats.server_calls = counters.server_calls
    stats.bytes_sent = counters.bytes_sent
    stats.bytes_received = counters.bytes_received
    stats.payload_bytes = getattr(counters, "payload_bytes", 0)
    stats.prefill_payload_bytes = getattr(counters, "prefill_payload_bytes", 0)
    calls = max(counters.server_calls, 1)
    stats.bytes_up_per_round = counters.bytes_sent / calls
    stats.bytes_down_per_round = counters.bytes_received / calls
    stats.bytes_down_per_token = counters.bytes_received / max(stats.new_tokens, 1)
    stats.payload_bytes_per_token = (stats.payload_bytes - stats.prefill_payload_bytes) / max(stats.new_tokens, 1)
    stats.server_compute_s = counters.server_compute_s
    link = getattr(verifier, "link", None)
    for name, value in (link.as_stats() if link is not None else {}).items():
        setattr(stats, name, value)
