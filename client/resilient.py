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
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from client.decode import GenerationStats, copy_link_stats
from client.drafters.base import Drafter
from client.heartbeat import Heartbeat
from client.offline import local_token, reconcile_verify
from client.verifiers import LinkDown, SessionLost
from shared.acceptance import SamplingParams
from shared.errors import SplitspecError

MIN_DEADLINE_S = 0.1
DEADLINE_MARGIN_S = 0.05
MIN_POLL_S = 0.25  # the shortest wait for a reconnection poll's answer
UNMEASURED_RTT_S = 1.0  # stands in for SRTT + 4·RTTVAR before the link has been measured


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
    offline_s: float = 0.0  # from each detected failure to the settlement (or the end)
    local_s: float = 0.0  # of which spent generating local tokens
    switch_s: list[float] = field(default_factory=list)  # from the failing call's start to local generation
    switched_at: list[float] = field(default_factory=list)  # perf_counter() when local generation began
    heartbeat_probes: int = 0

    @property
    def local_tokens_per_s(self) -> float:
        return self.local_tokens / self.local_s if self.local_s > 0 else 0.0


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
    settle_wait_s: float | None = None,
    on_update: Callable[[list[int], list[bool]], None] | None = None,
    heartbeat: bool = True,
) -> ResilientGeneration:
    """Generate like ``speculative_generate``, carrying on locally through link failures.

    ``max_offline_s`` bounds one stretch without the server; ``settle_wait_s`` bounds how long a
    generation already complete offline waits for the server to settle it (default: the rest of
    ``max_offline_s``; 0 returns at once with the tail unverified). ``on_update(tokens, verified)``
    sees the whole output after every change: local tokens appear unverified and may later be
    replaced (policy verify) — a streaming consumer prints what is verified, or all of it under keep.
    ``heartbeat`` probes the server on a connection of its own (``client.heartbeat``) so that a
    silent cut is noticed within about two round trips, not only at a Verify's deadline.
    """
    if on_reconnect not in ("verify", "keep"):
        raise ValueError(f"on_reconnect must be 'verify' or 'keep', got {on_reconnect!r}")
    run = _Run(verifier, drafter, list(prompt_ids), max_new_tokens, sampling, on_reconnect,
               max_tree_nodes, backoff or Backoff(), max_offline_s, settle_wait_s, on_update)  # fmt: skip
    if not heartbeat or not hasattr(verifier, "abort"):
        return run.generate()
    run.heartbeat = Heartbeat(verifier.address, verifier.link)
    run.heartbeat.on_dead(verifier.abort)
    try:
        return run.generate()
    finally:
        run.heartbeat.close()


def verify_deadline(link, verify_s: float, bytes_up: int, bytes_down: float) -> float:
    """How long a Verify may take before the link is presumed dead: the RTT bound (SRTT + 4·RTTVAR),
    the server's expected compute with headroom, the transfers at the measured rates, a margin."""
    rtt = link.timeout_s() if link is not None else None
    transfer = link.transfer_s(bytes_up, int(bytes_down)) if link is not None else 0.0
    rtt = UNMEASURED_RTT_S if rtt is None else rtt
    return max(MIN_DEADLINE_S, rtt + 1.5 * verify_s + transfer + DEADLINE_MARGIN_S)


class _Run:
    """One resilient generation: the output so far, which of it is verified, and the settings."""

    def __init__(self, verifier, drafter, prompt_ids, limit, sampling, policy, max_nodes, backoff, max_offline_s,
                 settle_wait_s, on_update):  # fmt: skip
        self.verifier, self.drafter, self.prompt_ids, self.limit = verifier, drafter, prompt_ids, limit
        self.sampling, self.policy, self.max_nodes, self.backoff = sampling, policy, max_nodes, backoff
        self.max_offline_s, self.settle_wait_s, self.on_update = max_offline_s, settle_wait_s, on_update
        self.stop = set(verifier.eos_token_ids)
        self.stats = ResilienceStats()
        self.out: list[int] = []
        self.verified: list[bool] = []
        self.heartbeat: Heartbeat | None = None
        self.generator = torch.Generator().manual_seed(sampling.seed)  # offline sampling: reproducible per seed

    def generate(self) -> ResilientGeneration:
        verifier, drafter, stats = self.verifier, self.drafter, self.stats
        before = replace(verifier.counters)
        start = time.perf_counter()
        self._open([])
        stats.ttft_s = time.perf_counter() - start
        if self.heartbeat:
            self.heartbeat.start()  # the prefill gave the link an RTT estimate to set its deadline from
        # running estimates of one verification, for the deadline: the prefill's compute is the first guess
        verify_s, reply_bytes = self.prefill_s, 0.0
        reason = ""
        try:
            while not (reason := self._finished()):
                t0 = time.perf_counter()
                tree = drafter.propose(min(self.max_nodes, verifier.max_tree_nodes, self.limit))
                stats.draft_s += time.perf_counter() - t0
                call = time.perf_counter()
                received = verifier.counters.bytes_received
                try:
                    if self.heartbeat and self.heartbeat.dead.is_set():
                        raise LinkDown(f"server {verifier.address}: {self.heartbeat.reason}")
                    deadline = verify_deadline(verifier.link, verify_s, 8 * len(tree) + 64, 2 * reply_bytes)
                    result = verifier.verify(tree, timeout_s=deadline)
                except (LinkDown, SessionLost):
                    stats.disconnects += 1
                    stats.switch_s.append(time.perf_counter() - call)
                    self._offline()
                    continue
                compute = max(result.compute_s, 0.0)
                verify_s = max(compute, 0.8 * verify_s + 0.2 * compute)  # up at once, down slowly
                reply_bytes = 0.8 * reply_bytes + 0.2 * (verifier.counters.bytes_received - received)
                stats.rounds += 1
                drafter.absorb(result.new_tokens, result.features)
                self._commit(self.out + result.new_tokens, self.verified + [True] * len(result.new_tokens))
        finally:
            try:
                verifier.close(timeout_s=1.0)
            except SplitspecError:  # the link may be down for good: the server's TTL frees the session
                verifier.session_id = ""
        out, verified = self.out[: self.limit], self.verified[: self.limit]
        if reason == "stop":
            cut = next(i for i, t in enumerate(out) if t in self.stop) + 1
            out, verified = out[:cut], verified[:cut]
        stats.new_tokens, stats.wall_s = len(out), time.perf_counter() - start
        stats.tokens_per_s = len(out) / stats.wall_s
        stats.acceptance_length = sum(verified) / stats.rounds if stats.rounds else 0.0
        copy_link_stats(stats, verifier, before)
        stats.heartbeat_probes = self.heartbeat.probes if self.heartbeat else 0
        return ResilientGeneration(out, verified, reason, stats)

    def _commit(self, out: list[int], verified: list[bool]) -> None:
        self.out, self.verified = out, verified
        if self.on_update:
            self.on_update(out[: self.limit], verified[: self.limit])

    def _finished(self) -> str:
        if any(t in self.stop for t in self.out):
            return "stop"
        if len(self.out) >= self.limit:
            return "length"
        if len(self.prompt_ids) + len(self.out) >= self.verifier.max_context:
            return "context"
        return ""

    def _open(self, history: list[int]) -> list[int]:
        """(Re)open a session after ``prompt + history``; returns the history plus the server's next token."""
        verifier = self.verifier
        if getattr(verifier, "session_id", ""):
            try:
                verifier.close(timeout_s=2.0)  # the old session, if the server still has it
            except SplitspecError:
                verifier.session_id = ""
        opened = verifier.open(self.prompt_ids + history, self.sampling, self.drafter.features)
        self.prefill_s = opened.compute_s
        tokens = history + opened.new_tokens
        self.drafter.begin(self.prompt_ids + tokens, opened.features)
        if not history:
            self._commit(tokens, [True] * len(tokens))
        return tokens

    def _offline(self) -> None:
        """Generate locally until the server answers again (or the budget ends), then settle the local tail.

        A settlement the link breaks again leaves the drafter half-settled: the next one reopens the
        session from the verified history instead, and no more local tokens are made meanwhile.
        """
        stats = self.stats
        began, first_local, fresh = time.perf_counter(), len(self.out), True
        stats.switched_at.append(began)
        try:
            while True:
                reconnector = Reconnector(self._reachable, self.backoff)
                reconnector.start()
                try:
                    if fresh:
                        self._generate_locally(reconnector, began)
                    wait = self.max_offline_s - (time.perf_counter() - began)
                    if self._finished() and self.settle_wait_s is not None:
                        wait = min(wait, self.settle_wait_s)
                    if not reconnector.up.wait(max(0.0, wait)):
                        return  # out of budget: the tail stays unverified
                finally:
                    reconnector.stop.set()
                    stats.reconnect_attempts += reconnector.attempts
                stats.reconnects += 1
                try:
                    self._settle(first_local, fresh)
                    if self.heartbeat:
                        self.heartbeat.revive()
                    return
                except (LinkDown, SessionLost):
                    stats.disconnects += 1
                    fresh = False
        finally:
            stats.offline_s += time.perf_counter() - began

    def _reachable(self) -> bool:
        """One Handshake, given as long as a healthy link would need, so a dead one costs each poll little."""
        link = getattr(self.verifier, "link", None)
        bound = link.timeout_s() if link is not None else None
        return self.verifier.reachable(timeout_s=max(MIN_POLL_S, 2 * bound + 0.1) if bound else 1.0)

    def _generate_locally(self, reconnector: Reconnector, began: float) -> None:
        t0 = time.perf_counter()
        try:
            while not reconnector.up.is_set():
                if self._finished() or time.perf_counter() - began > self.max_offline_s:
                    return
                token = local_token(self.drafter, self.sampling, self.generator)
                if token is None:  # nothing to offer offline (prompt lookup without a match): wait
                    reconnector.up.wait(0.05)
                    continue
                self.stats.local_tokens += 1
                self._commit(self.out + [token], self.verified + [False])
        finally:
            self.stats.local_s += time.perf_counter() - t0

    def _settle(self, first_local: int, fresh: bool) -> None:
        """The history after reconnection: the local tail kept (keep) or verified against the target (verify)."""
        verifier, drafter = self.verifier, self.drafter
        out, verified = self.out, self.verified
        local = out[first_local:]
        chunk = max(1, verifier.max_tree_nodes)  # settle in as few calls as the server allows
        if self.policy == "keep":
            tail = self._open(out)
            self._commit(tail, verified[: len(out)] + [True] * (len(tail) - len(out)))
            return
        if fresh:
            try:
                replaced = reconcile_verify(verifier, drafter, local, chunk)
                self._commit(out[:first_local] + replaced, verified[:first_local] + [True] * len(replaced))
                return
            except SessionLost:  # the server forgot us, or is out of step: reopen from what was verified
                pass
        history = out[:first_local]
        reopened = self._open(history[:-1])
        if reopened[-1] != history[-1]:  # (sampling) the target now picks another root: the tail goes
            self._commit(reopened, verified[: len(reopened) - 1] + [True])
            return
        for token in local:
            drafter.absorb([token])
        replaced = reconcile_verify(verifier, drafter, local, chunk)
        self._commit(history + replaced, verified[:first_local] + [True] * len(replaced))
