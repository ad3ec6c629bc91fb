"""The API baseline: the server decodes alone and streams its tokens (the ``Complete`` call), as a streaming
completion API does. It is what every split figure is compared against; it drafts nothing and verifies nothing."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import replace

from client.loop.decode import Generation, GenerationStats, copy_link_stats
from client.net.connection import Connection
from client.net.remote import RemoteVerifier, sampling_msg
from shared.acceptance import SamplingParams
from shared.wire import splitspec_pb2 as pb


def api_complete(
    remote: RemoteVerifier,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    stop_ids: list[int] | None = None,
    on_update: Callable[[list[int], list[bool]], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Generation:
    """The API baseline: the server decodes alone and streams tokens; no drafts, one call."""
    stop = list(remote.eos_token_ids if stop_ids is None else stop_ids)
    stats = GenerationStats()
    before = replace(remote.counters)
    start = clock()
    out: list[int] = []
    reason = "length"
    for tokens in api_tokens(remote.connection, list(prompt_ids), sampling, max_new_tokens, stop):
        if not out:
            stats.ttft_s = clock() - start
        out += tokens
        if on_update:
            on_update(out, [True] * len(out))
        if tokens and tokens[-1] in stop:
            reason = "stop"
    stats.wall_s = clock() - start
    stats.new_tokens = len(out)
    stats.tokens_per_s = len(out) / stats.wall_s if stats.wall_s > 0 else 0.0
    stats.rounds = len(out)
    stats.acceptance_length = 1.0
    copy_link_stats(stats, remote, before)
    stats.reused_tokens = remote.counters.reused_tokens - before.reused_tokens
    return Generation(out, [True] * len(out), reason, stats)


def api_tokens(connection: Connection, prompt_ids: list[int], sampling: SamplingParams, max_new_tokens: int,
               stop_ids: list[int]) -> Iterator[list[int]]:
    """The Complete call: the server's plain streaming decode (the API baseline); yields lists of tokens."""
    request = pb.CompleteRequest(
        prompt_ids=prompt_ids,
        sampling=sampling_msg(sampling),
        max_new_tokens=max_new_tokens,
        stop_token_ids=stop_ids,
    )
    first_bound = connection.bounds.call_s(len(prompt_ids), request.ByteSize())

    def gap_s(i: int) -> float:  # the first chunk waits for the prefill, the others for a step each
        return first_bound if i == 0 else connection.bounds.call_s(1)

    connection.route.follow(prompt_ids)  # on a cluster, the replica holding the conversation's prefix
    # gRPC's deadline covers the whole stream: allow a generous second per requested token
    call, start, chunks = connection.stream("Complete", request, connection.rpc_timeout_s + max_new_tokens, gap_s,
                                       watched=False, opens=True)  # fmt: skip
    for i, chunk in enumerate(chunks):
        size = connection.count(received=chunk)
        connection.bounds.observe(len(prompt_ids) if i == 0 else max(1, len(chunk.tokens)), chunk.compute_s)
        if i == 0:  # the first chunk is one round trip around the prefill; later ones are pipelined
            connection.link.observe(time.perf_counter() - start, chunk.compute_s, request.ByteSize(), size)
            connection.counters.reused_tokens += chunk.reused_tokens
        yield list(chunk.tokens)
