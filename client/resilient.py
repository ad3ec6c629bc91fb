"""The decode loop that survives the link: local generation while it is down, reconciliation when it is back.

Online it is the ordinary loop, with each Verify given a deadline from the measured RTT and
verification time. A call that fails for the link (``LinkDown``: refused, reset, deadline) switches
to local generation at once (``client.offline.local_token``: the drafter, with TLI through the
target's own last layers), while a background thread polls the server with jittered exponential
backoff. When it answers, the unverified tail is settled by policy:

* ``verify`` — the server verifies it as one chain (``reconcile_verify``): the accepted prefix is
  kept, the target's token replaces the first divergence, the rest is dropped; greedy output ends
  exactly as an uninterrupted run's.
* ``keep`` — the server takes the local tokens as they are (the session is reopened from the whole
  history) and decoding continues after them.

A session the server lost (TTL, restart) is reopened from the token history the client holds.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field

from client.decode import GenerationStats
from client.drafters.base import Drafter
from client.offline import local_token, reconcile_verify
from client.verifiers import LinkDown, SessionLost
from shared.acceptance import SamplingParams
from shared.errors import SplitspecError

MIN_DEADLINE_S = 0.25


@dataclass
class Backoff:
    """Jittered exponential backoff, bounded: base·factor^k, at most ``cap_s``, times U(1 - jitter, 1)."""

    base_s: float = 0.05
    factor: float = 2.0
    cap_s: float = 1.0
    jitter: float = 0.5
    seed: int | None = None

    def delays(self):
        rng, delay = random.Random(self.seed), self.base_s
        while True:
            yield delay * rng.uniform(1 - self.jitter, 1)
            delay = min(self.cap_s, delay * self.factor)


@dataclass
class ResilienceStats(GenerationStats):
    local_tokens: int = 0  # tokens generated without the server (kept or not)
    disconnects: int = 0
    reconnects: int = 0
    reconnect_attempts: int = 0  # server polls while offline
    offline_s: float = 0.0
    switch_s: list[float] = field(default_factory=list)  # from the failing call's start to local generation


@dataclass
class ResilientGeneration:
    token_ids: list[int]
    verified: list[bool]  # per token: did the server verify it
    finish_reason: str
    stats: ResilienceStats


class Reconnector(threading.Thread):
    """Polls ``reachable()`` with backoff until it answers (sets ``up``) or ``stop`` is set."""

    def __init__(self, reachable, backoff: Backoff):
        super().__init__(daemon=True, name="splitspec-reconnect")
        self.reachable, self.backoff = reachable, backoff
        self.up, self.stop = threading.Event(), threading.Event()
        self.attempts = 0

    def run(self) -> None:
        for delay in self.backoff.delays():
            if self.stop.is_set():
                return
            self.attempts += 1
            if self.reachable():
                self.up.set()
                return
            if self.stop.wait(delay):
                return


def resilient_generate(
    verifier,
    drafter: Drafter,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    on_reconnect: str = "verify",
    max_tree_nodes: int = 16,
    backoff: Backoff | None = None,
    max_offline_s: float = 600.0,
) -> ResilientGeneration:
    """Generate like ``speculative_generate``, carrying on locally through link failures."""
    if on_reconnect not in ("verify", "keep"):
        raise ValueError(f"on_reconnect must be 'verify' or 'keep', got {on_reconnect!r}")
    backoff = backoff or Backoff()
    stop = set(verifier.eos_token_ids)
    stats = ResilienceStats()
    start = time.perf_counter()
    prompt_ids = list(prompt_ids)
    out, verified = _open(verifier, drafter, prompt_ids, sampling, [])
    stats.ttft_s = time.perf_counter() - start
    settle = (prompt_ids, sampling, stats, stop, max_new_tokens, on_reconnect, max_tree_nodes, backoff, max_offline_s)
    verify_s = 0.1  # running estimate of one verification, for the deadline
    reason = ""
    try:
        while not (reason := _finished(out, stop, max_new_tokens, verifier, prompt_ids)):
            t0 = time.perf_counter()
            tree = drafter.propose(min(max_tree_nodes, verifier.max_tree_nodes, max_new_tokens))
            stats.draft_s += time.perf_counter() - t0
            call = time.perf_counter()
            try:
                deadline = 2 * verify_s + (verifier.link.timeout_s() or 0.0) + 0.1
                result = verifier.verify(tree, timeout_s=max(MIN_DEADLINE_S, deadline))
            except (LinkDown, SessionLost):
                stats.disconnects += 1
                stats.switch_s.append(time.perf_counter() - call)
                out, verified = _offline(verifier, drafter, out, verified, *settle)
                continue
            verify_s = 0.8 * verify_s + 0.2 * max(result.compute_s, 0.0)
            stats.rounds += 1
            drafter.absorb(result.new_tokens, result.features)
            out += result.new_tokens
            verified += [True] * len(result.new_tokens)
    finally:
        try:
            verifier.close(timeout_s=1.0)
        except SplitspecError:  # the link may be down for good: the server's TTL frees the session
            verifier.session_id = ""
    out, verified = out[:max_new_tokens], verified[:max_new_tokens]
    if reason == "stop":
        cut = next(i for i, t in enumerate(out) if t in stop) + 1
        out, verified = out[:cut], verified[:cut]
    stats.new_tokens, stats.wall_s = len(out), time.perf_counter() - start
    stats.tokens_per_s = len(out) / stats.wall_s
    stats.acceptance_length = sum(verified) / stats.rounds if stats.rounds else 0.0
    return ResilientGeneration(out, verified, reason, stats)


def _finished(out: list[int], stop: set[int], limit: int, verifier, prompt_ids) -> str:
    if any(t in stop for t in out):
        return "stop"
    if len(out) >= limit:
        return "length"
    if len(prompt_ids) + len(out) >= verifier.max_context:
        return "context"
    return ""


def _open(verifier, drafter: Drafter, prompt_ids: list[int], sampling, history: list[int]):
    """(Re)open a session after ``prompt_ids + history``; the server's first token joins the history."""
    if getattr(verifier, "session_id", ""):
        try:
            verifier.close(timeout_s=2.0)  # the old session, if the server still has it
        except SplitspecError:
            verifier.session_id = ""
    opened = verifier.open(prompt_ids + history, sampling, drafter.features)
    tokens = history + opened.new_tokens
    drafter.begin(prompt_ids + tokens, opened.features)
    return tokens, [True] * len(tokens)


def _offline(verifier, drafter, out, verified, prompt_ids, sampling, stats, stop, limit, on_reconnect,
             max_nodes, backoff, max_offline_s):  # fmt: skip
    """Generate locally until the server answers again (or the budget ends), then settle the local tail.

    A settlement the link breaks again leaves the drafter half-settled: the next one reopens the
    session from the verified history instead, and no more local tokens are made meanwhile.
    """
    began, first_local, fresh = time.perf_counter(), len(out), True
    try:
        while True:
            reconnector = Reconnector(verifier.reachable, backoff)
            reconnector.start()
            try:
                while fresh and not reconnector.up.is_set():
                    if _finished(out, stop, limit, verifier, prompt_ids) or time.perf_counter() - began > max_offline_s:
                        break
                    token = local_token(drafter)
                    if token is None:  # nothing to offer offline (prompt lookup without a match): wait
                        reconnector.up.wait(0.05)
                        continue
                    out.append(token)
                    verified.append(False)
                    stats.local_tokens += 1
                if not reconnector.up.wait(max(0.0, max_offline_s - (time.perf_counter() - began))):
                    return out, verified  # out of budget: the tail stays unverified
            finally:
                reconnector.stop.set()
                stats.reconnect_attempts += reconnector.attempts
            stats.reconnects += 1
            try:
                chunk = max(1, verifier.max_tree_nodes)  # settle in as few calls as the server allows
                return _settle(verifier, drafter, out, verified, first_local, fresh, prompt_ids, sampling,
                               on_reconnect, chunk)  # fmt: skip
            except (LinkDown, SessionLost):
                stats.disconnects += 1
                fresh = False
    finally:
        stats.offline_s += time.perf_counter() - began


def _settle(verifier, drafter, out, verified, first_local, fresh, prompt_ids, sampling, on_reconnect, max_nodes):
    """The history after reconnection: ``out[first_local:]`` kept (keep) or verified against the target (verify)."""
    local = out[first_local:]
    if on_reconnect == "keep":
        tail, _ = _open(verifier, drafter, prompt_ids, sampling, out)
        return tail, verified[: len(out)] + [True] * (len(tail) - len(out))
    if fresh:
        try:
            replaced = reconcile_verify(verifier, drafter, local, max_nodes)
            return out[:first_local] + replaced, verified[:first_local] + [True] * len(replaced)
        except SessionLost:  # the server forgot us, or is out of step: reopen from what was verified
            pass
    history = out[:first_local]
    reopened, _ = _open(verifier, drafter, prompt_ids, sampling, history[:-1])
    if reopened[-1] != history[-1]:  # (sampling) the target now picks another root: the tail goes
        return reopened, verified[: len(reopened) - 1] + [True]
    for token in local:
        drafter.absorb([token])
    replaced = reconcile_verify(verifier, drafter, local, max_nodes)
    return history + replaced, verified[:first_local] + [True] * len(replaced)
