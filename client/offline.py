"""Generating without the server, and making peace with it afterwards.

``bridge`` is what the decode loop (``client.decode``) runs when a Verify fails for the link: the
drafter itself is the model — its most likely next token (for MoA with TLI>0, through the target's
own last layers) is committed unverified, one at a time, through the ordinary drafter interface
(``propose(1, depth=1)`` then ``absorb``), no drafter-specific code — while a background thread
polls the server with jittered exponential backoff. When it answers, the unverified tail is settled:

* ``verify`` — ``reconcile_verify`` has the server verify it as one chain (in chunks of the server's
  tree limit): the accepted prefix is kept, the target's token replaces the first divergence, the
  rest is dropped; greedy output ends exactly as an uninterrupted run's.
* ``keep`` — the server takes the local tokens as they are (the session is reopened from the whole
  history) and decoding continues after them.

A session the server lost (TTL, restart) is reopened from the token history the client holds.
"""

from __future__ import annotations

import math
import random
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from client.drafters.base import Drafter
from client.failures import LinkDown, SessionLost
from client.verifiers import NO_PAYLOAD, Verifier
from shared.acceptance import SamplingParams, target_probs
from shared.errors import SplitspecError
from shared.payload import PayloadSpec
from shared.target import Verdict
from shared.tree import DraftTree

if TYPE_CHECKING:  # (the decode loop imports this module)
    from client.adaptive import AdaptivePolicy
    from client.decode import GenerationStats, Resilience
    from client.heartbeat import Heartbeat

MIN_POLL_S = 0.25  # the shortest wait for a reconnection poll's answer
STOP_POLL_S = 0.1  # how often a wait for the link looks whether the process is stopping
SETTLE_LOSSES = 8  # settlements in a row the server answers but loses the session of, before giving up
FIRST_CHUNK = 4  # local tokens in the first verification of a reconnected tail (see reconcile_verify)


@dataclass
class Backoff:
    """Jittered exponential backoff, bounded: base·factor^k, at most ``cap_s``, times U(1 - jitter, 1)."""

    base_s: float = 0.05
    factor: float = 2.0
    cap_s: float = 0.5
    jitter: float = 0.5
    seed: int | None = None

    def delays(self):
        rng, delay = random.Random(self.seed), self.base_s
        while True:
            yield delay * rng.uniform(1 - self.jitter, 1)
            delay = min(self.cap_s, delay * self.factor)


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


class Bridged(Protocol):
    """What ``bridge`` uses of a generation under way (``client.decode.Run``)."""

    verifier: Verifier
    drafter: Drafter
    policy: AdaptivePolicy | None
    resilience: Resilience
    sampling: SamplingParams
    generator: torch.Generator  # offline draws
    stats: GenerationStats
    heartbeat: Heartbeat | None
    prompt_ids: list[int]
    out: list[int]
    verified: list[bool]  # per token of ``out``
    spec: PayloadSpec  # the features its calls ask for
    unfeatured: tuple[int, int] | None  # cached tokens whose features a cut mid-stream kept away

    def finished(self) -> str: ...

    def commit(self, out: list[int], verified: list[bool]) -> None: ...

    def open(self, history: list[int]) -> Verdict: ...


def bridge(run: Bridged) -> None:
    """Generate locally until the server answers again (or the budget ends), then settle the local tail.

    ``run`` is the decode loop's ``client.decode.Run``. A settlement the link breaks again leaves the
    drafter half-settled: the next one reopens the session from the verified history instead, and no
    more local tokens are made meanwhile.
    """
    stats, resilience = run.stats, run.resilience
    began, first_local, fresh, losses = time.perf_counter(), len(run.out), True, 0
    stats.switched_at.append(began)
    try:
        while True:
            reconnector = Reconnector(lambda: _reachable(run.verifier), resilience.backoff)
            reconnector.start()
            try:
                if fresh:
                    if run.unfeatured:
                        _catch_up(run)
                    _generate_locally(run, reconnector, began)
                wait = resilience.max_offline_s - (time.perf_counter() - began)
                if run.finished() and resilience.settle_wait_s is not None:
                    wait = min(wait, resilience.settle_wait_s)
                if not _wait_for_link(reconnector, wait, resilience.stop):
                    return  # out of budget, or the process is stopping: the tail stays unverified
            finally:
                reconnector.stop.set()
                reconnector.join(timeout=2 * MIN_POLL_S)  # a poll under way ends within its own deadline or is cut
                stats.reconnect_attempts += reconnector.attempts
            stats.reconnects += 1
            try:
                _settle(run, first_local, fresh, _keeping(run, began))
                if run.heartbeat:
                    run.heartbeat.revive()
                return
            except (LinkDown, SessionLost) as exc:
                stats.disconnects += 1
                fresh = False
                losses = losses + 1 if isinstance(exc, SessionLost) else 0
                if losses >= SETTLE_LOSSES:  # it answers, and fails every session: not a link to wait out
                    raise SplitspecError(f"the server lost the session {losses} times in a row while settling "
                                         f"({exc}); giving up") from None  # fmt: skip
    finally:
        stats.offline_s += time.perf_counter() - began


def _wait_for_link(reconnector: Reconnector, seconds: float, stop: threading.Event | None) -> bool:
    """Whether the link came back within ``seconds``; False at once when ``stop`` is set (the process is stopping:
    nobody will read what a settlement would give)."""
    deadline = time.perf_counter() + max(0.0, seconds)
    while not (stop is not None and stop.is_set()):
        left = deadline - time.perf_counter()
        if reconnector.up.wait(min(max(left, 0.0), STOP_POLL_S)):
            return True
        if left <= 0:
            return False
    return False


def _reachable(verifier: Verifier) -> bool:
    """One Handshake, given as long as a healthy link would need, so a dead one costs each poll little."""
    bound = verifier.link.timeout_s() if verifier.link is not None else None
    return verifier.reachable(timeout_s=max(MIN_POLL_S, 2 * bound + 0.1) if bound else 1.0)


def _catch_up(run: Bridged) -> None:
    """The tokens streamed since the last payload (a cut kept their features away) fed to the drafter again as local
    tokens are — each after a proposal, so the drafter stands in its own features for the target's — so that it can
    generate after them; the target's own features replace those at the settlement."""
    start, end = run.unfeatured
    if start == 0:  # not even the prompt's arrived (a stream that opened the session): nothing to draft from until
        return  # the settlement fetches them
    tokens = (run.prompt_ids + run.out)[start + 1 : end + 1]
    run.drafter.rewind(len(tokens))
    run.drafter.assume(tokens)


def _keeping(run: Bridged, began: float) -> bool:
    """Will the local tokens be kept as they are (keep, or a cut past ``keep_after_s``) rather than verified?"""
    resilience = run.resilience
    late = resilience.keep_after_s is not None and time.perf_counter() - began > resilience.keep_after_s
    return resilience.on_reconnect == "keep" or late


def _generate_locally(run: Bridged, reconnector: Reconnector, began: float) -> None:
    """Local tokens until the link is back: the drafter's own (or ``resilience.offline``'s, which reads the context
    first and whose tokens the drafter then takes as it takes its own, so the settlement goes as ever)."""
    t0, survival, capped = time.perf_counter(), 1.0, False
    writer = run.resilience.offline or run.drafter
    calibration = min(1.0, run.policy.calibration) if run.policy is not None and writer is run.drafter else 1.0
    try:
        if writer is not run.drafter:
            writer.begin(run.prompt_ids + run.out)
        while not reconnector.up.is_set():
            stopping = run.resilience.stop is not None and run.resilience.stop.is_set()
            if stopping or run.finished() or time.perf_counter() - began > run.resilience.max_offline_s:
                return
            if survival < run.resilience.local_cap and not _keeping(run, began):
                run.stats.local_capped += not capped  # the rest would almost surely be discarded: wait for the server
                capped = True
                reconnector.up.wait(0.05)
                continue
            token, p = local_draw(writer, run.sampling, run.generator)
            if token is None:  # nothing to offer offline (prompt lookup without a match): wait
                reconnector.up.wait(0.05)
                continue
            if writer is not run.drafter:
                run.drafter.assume([token])
            survival *= 1.0 if p is None else calibration * p
            run.stats.local_tokens += 1
            run.commit(run.out + [token], run.verified + [False])
    finally:
        run.stats.local_s += time.perf_counter() - t0


def _settle(run: Bridged, first_local: int, fresh: bool, keep: bool) -> None:
    """The history after reconnection: the local tail kept (``keep``) or verified against the target."""
    verifier, drafter, out, verified = run.verifier, run.drafter, run.out, run.verified
    local = out[first_local:]
    chunk = max(1, verifier.max_tree_nodes)  # settle in as few calls as the server allows
    if keep:
        opened = out + run.open(out).new_tokens
        run.stats.local_kept += len(local)
        run.commit(opened, verified[: len(out)] + [True] * (len(opened) - len(out)))
        return
    if fresh:
        try:
            if run.unfeatured:  # a cut mid-stream kept the features of the last tokens away: fetch them first
                drafter.absorb([], verifier.fetch(*run.unfeatured, run.spec))
                run.unfeatured = None
            replaced = reconcile_verify(verifier, drafter, local, chunk, run.stats, run.spec)
            run.stats.local_kept += _agreed(local, replaced)
            run.commit(out[:first_local] + replaced, verified[:first_local] + [True] * len(replaced))
            return
        except SessionLost:  # the server forgot us, or is out of step: reopen from what was verified
            pass
    history = out[:first_local]
    opened = history[:-1] + run.open(history[:-1]).new_tokens
    if opened[-1] != history[-1]:  # (sampling) the target now picks another root: the tail goes
        run.commit(opened, verified[: len(opened) - 1] + [True])
        return
    for token in local:
        drafter.absorb([token])
    replaced = reconcile_verify(verifier, drafter, local, chunk, run.stats, run.spec)
    run.stats.local_kept += _agreed(local, replaced)
    run.commit(history + replaced, verified[:first_local] + [True] * len(replaced))


def _agreed(local: list[int], replaced: list[int]) -> int:
    """Local tokens the target agreed with: the common prefix."""
    return next((i for i, (a, b) in enumerate(zip(local, replaced, strict=False)) if a != b),
                min(len(local), len(replaced)))  # fmt: skip


def local_token(drafter: Drafter, sampling: SamplingParams = SamplingParams(),
                generator: torch.Generator | None = None, width: int = 8) -> int | None:  # fmt: skip
    """The drafter's own next token, committed (unverified); None if it has nothing to offer.

    Greedy: its most likely token. Sampling: a draw, at the requested temperature and top-p, among
    the first level of its tree (at most ``width`` tokens, the drafter's own top-B): a truncated
    version of its distribution, which a tree drafter does not expose whole.
    """
    return local_draw(drafter, sampling, generator, width)[0]


def local_draw(drafter: Drafter, sampling: SamplingParams = SamplingParams(), generator: torch.Generator | None = None,
               width: int = 8) -> tuple[int | None, float | None]:  # fmt: skip
    """``local_token`` and the drafter's own probability of it (None: the drafter gives none, prompt lookup)."""
    tree = drafter.propose(1 if sampling.temperature == 0 else width, 1)
    roots = [i for i, p in enumerate(tree.parents) if p == -1]
    if not roots:
        return None, None
    pick = roots[0] if sampling.temperature == 0 else _draw(tree, roots, sampling, generator)
    drafter.absorb([tree.tokens[pick]])
    return tree.tokens[pick], math.exp(tree.scores[pick]) if tree.scores else None


def _draw(tree: DraftTree, roots: list[int], sampling: SamplingParams, generator: torch.Generator | None) -> int:
    """Which of the tree's ``roots`` to take, drawn by the target's own rule from the drafter's probabilities."""
    if not tree.scores:  # no probabilities (prompt lookup): its one candidate
        return roots[0]
    probs = target_probs(torch.tensor([tree.scores[i] for i in roots]), sampling)
    return roots[torch.multinomial(probs, 1, generator=generator).item()]


def reconcile_verify(verifier: Verifier, drafter: Drafter, local: list[int], max_nodes: int, stats=None,
                     spec: PayloadSpec = NO_PAYLOAD) -> list[int]:  # fmt: skip
    """Verify the unverified tail ``local`` (already absorbed by ``drafter``; ``spec``: the features it needs);
    return what replaces it.

    The result is the longest prefix of ``local`` the target agrees with, then the target's own
    token where it first disagrees (or its token after the last local one, when a chunk ended
    there; when the last local token came back as the target's own choice, nothing is added).
    The drafter is rewound and fed
    the target's features along the way, so it continues exactly as after an ordinary round.

    Chunks start at ``FIRST_CHUNK`` tokens and double while every token is kept, up to ``max_nodes``: a local tail
    is mostly wrong early (the drafter alone drifts), and on a CPU a forward's cost grows with its tokens, so one
    forward over a long tail would pay for many tokens only to keep a few.
    """
    out: list[int] = []
    i, size = 0, min(FIRST_CHUNK, max(1, max_nodes))  # next local token not yet verified; the next chunk's size
    while i < len(local):
        chunk = local[i : i + size]
        result = verifier.verify(DraftTree.chain(chunk), spec=spec)
        if stats is not None:
            stats.reconcile_calls += 1
        accepted, bonus = len(result.accepted), result.new_tokens[-1]
        out += chunk[:accepted]
        i += accepted
        if i < len(local) and local[i] == bonus:  # the target picks the next local token too: go on from it
            drafter.absorb([], result.features)
            out.append(bonus)
            i += 1
            size = min(2 * size, max(1, max_nodes))
            continue
        drafter.rewind(len(local) - i)
        drafter.absorb([bonus], result.features)
        out.append(bonus)
        return out
    return out
