"""Generating without the server, and making peace with it afterwards.

``Bridge`` is what the decode loop (``client.loop.decode``) runs when a Verify fails for the link: the
drafter itself is the model — its most likely next token (for MoA with TLI>0, through the target's
own last layers) is committed unverified, one at a time, through the ordinary drafter interface
(``propose(1, depth=1)`` then ``absorb``), no drafter-specific code — while a background thread
polls the server with jittered exponential backoff. When it answers, the unverified tail is settled:

* ``verify`` — ``settle_verify`` has the server verify it as one chain (in chunks of the server's
  tree limit): the accepted prefix is kept, the target's token replaces the first divergence, the
  rest is dropped; greedy output ends exactly as an uninterrupted run's.
* ``keep`` — the server takes the offline tokens as they are (the session is reopened from the whole
  history) and decoding continues after them.

A session the server lost (TTL, restart) is reopened from the token history the client holds.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from client.drafters.base import Drafter
from client.net.failures import LinkDown, SessionLost
from client.net.heartbeat import Heartbeat
from client.verifiers import NO_PAYLOAD, Verifier
from shared.acceptance import SamplingParams, target_probs
from shared.errors import SplitspecError
from shared.payload import PayloadSpec
from shared.tree import DraftTree

ON_RECONNECT = ("verify", "keep", "fail")
OFFLINE_CAP = 0.3  # see Resilience.offline_cap

MIN_POLL_S = 0.25  # the shortest wait for a reconnection poll's answer
STOP_POLL_S = 0.1  # how often a wait for the link looks whether the process is stopping
SETTLE_LOSSES = 8  # settlements in a row the server answers but loses the session of, before giving up
FIRST_CHUNK = 4  # offline tokens in the first verification of a reconnected tail (see settle_verify)


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


@dataclass
class Resilience:
    """What a generation does when the link fails (see the module docstring).

    ``max_offline_s`` bounds one stretch without the server; ``settle_wait_s`` bounds how long a
    generation already complete offline waits for the server to settle it (None: the rest of
    ``max_offline_s``; 0: return at once with the tail unverified). ``heartbeat`` probes the server
    on a connection of its own (``client.net.heartbeat``) so that a silent cut is noticed within about
    two round trips, not only at a Verify's deadline. ``keep_after_s``: under ``verify``, a cut that
    lasts longer keeps its offline tokens as ``keep`` does (None: never). ``offline_cap``: while offline
    tokens are to be verified, offline generation waits once the chance that all of them survive — the
    drafter's own probabilities, calibrated by how often the target took its first choices (``Sizing.survival``) —
    falls below this (0: never waits): the next token would more likely be shown and then replaced. With each
    token surviving with chance a, a cap T stops after ln T / ln a tokens, of which the target keeps a share of
    about (1 - T) / -ln T whatever a is: the default 0.3 shows text of which ~58 % stays. ``stop``: set when the
    process is stopping (the edge on SIGTERM): a generation waiting for the link ends at once, its offline tail
    unverified.
    ``offline``: the drafter that writes the offline tokens (default None: the generation's own drafter) — a whole
    model (the 0.5B beside a MoA drafter), which writes text a long cut can keep; it reads the context at the cut.
    """

    on_reconnect: str = "verify"
    backoff: Backoff = field(default_factory=Backoff)
    max_offline_s: float = 600.0
    settle_wait_s: float | None = None
    heartbeat: bool = True
    keep_after_s: float | None = None
    offline_cap: float = OFFLINE_CAP
    stop: threading.Event | None = None
    offline: Drafter | None = None

    def __post_init__(self) -> None:
        if self.on_reconnect not in ON_RECONNECT:
            raise ValueError(f"on_reconnect must be one of {', '.join(ON_RECONNECT)}, got {self.on_reconnect!r}")
        if self.keep_after_s is not None and not self.keep_after_s >= 0:
            raise ValueError(f"keep_after_s must be >= 0 seconds or None, got {self.keep_after_s!r}")
        if not 0 <= self.offline_cap < 1:
            raise ValueError(f"offline_cap must be a probability in [0, 1), got {self.offline_cap!r}")


@dataclass
class OfflineStats:
    """What the link's failures cost a generation: all zero in one it never failed in (``GenerationStats`` holds
    them as its own)."""

    offline_tokens: int = 0  # tokens generated without the server (kept or not)
    offline_kept: int = 0  # of which the settlement kept (the server agreed with them, or they were kept as they are)
    offline_capped: int = 0  # times offline generation waited: what followed would almost surely have been thrown away
    disconnects: int = 0
    reconnects: int = 0
    reconnect_attempts: int = 0  # server polls while offline
    settle_calls: int = 0  # Verify calls that settled offline tokens
    offline_s: float = 0.0  # from each detected failure to the settlement (or the end)
    offline_gen_s: float = 0.0  # of which spent generating offline tokens
    switch_s: list[float] = field(default_factory=list)  # from the failing call's start to offline generation
    switched_at: list[float] = field(default_factory=list)  # the clock's time when offline generation began

    def add(self, other: OfflineStats) -> None:
        """Count ``other`` (one cut's) in too."""
        for name in OfflineStats.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


def unmeasured(p: float | None) -> float:
    """An offline token's chance of surviving by its writer's word alone (a copy's: 1)."""
    return 1.0 if p is None else p


@dataclass
class Cut:
    """A generation as it stood when its link failed: what the offline stage reads (and which collaborators it
    drives: ``verifier``, ``drafter``, ``heartbeat``). ``finished(out, verified)``: why an output is complete ("" if
    it is not; the loop's own rule); ``unfeatured``: cached tokens whose features a cut mid-stream kept away;
    ``survival(p)``: the chance that an offline token the drafter gave probability p (None: a copy) is the target's own
    (the policy's measure of the drafter); ``clock``: seconds, for every bound."""

    verifier: Verifier
    drafter: Drafter
    resilience: Resilience
    prompt_ids: list[int]
    out: list[int]
    verified: list[bool]  # per token of ``out``
    finished: Callable[[list[int], list[bool]], str]
    sampling: SamplingParams = SamplingParams()
    generator: torch.Generator | None = None  # offline draws
    spec: PayloadSpec = NO_PAYLOAD  # the features its calls ask for
    unfeatured: tuple[int, int] | None = None
    survival: Callable[[float | None], float] = unmeasured
    heartbeat: Heartbeat | None = None
    clock: Callable[[], float] = time.perf_counter


class Bridge:
    """The offline stage of one cut: ``outputs()`` yields each output it makes — offline tokens as they come, then the
    settled history — for the decode loop to apply; afterwards ``stats`` says what the cut cost and ``unfeatured``
    what is still to be fetched. It never writes the loop's state: it reads the ``Cut`` and keeps its own copy."""

    def __init__(self, cut: Cut) -> None:
        self.cut = cut
        self.out, self.verified, self.unfeatured = list(cut.out), list(cut.verified), cut.unfeatured
        self.stats = OfflineStats()

    def outputs(self) -> Iterator[tuple[list[int], list[bool]]]:
        """Generate offline until the server answers again (or the budget ends), then settle the offline tail.

        A settlement the link breaks again leaves the drafter half-settled: the next one reopens the session from
        the verified history instead, and no more offline tokens are made meanwhile.
        """
        cut, stats, resilience, clock = self.cut, self.stats, self.cut.resilience, self.cut.clock
        began, first_offline, fresh, losses = clock(), len(self.out), True, 0
        stats.switched_at.append(began)
        try:
            while True:
                reconnector = Reconnector(lambda: _reachable(cut.verifier), resilience.backoff)
                reconnector.start()
                try:
                    if fresh:
                        if self.unfeatured:
                            self._catch_up()
                        yield from self._generate_offline(reconnector, began)
                    wait = resilience.max_offline_s - (clock() - began)
                    if cut.finished(self.out, self.verified) and resilience.settle_wait_s is not None:
                        wait = min(wait, resilience.settle_wait_s)
                    if not _wait_for_link(reconnector, wait, resilience.stop, clock):
                        return  # out of budget, or the process is stopping: the tail stays unverified
                finally:
                    reconnector.stop.set()
                    reconnector.join(timeout=2 * MIN_POLL_S)  # a poll under way ends within its own deadline or is cut
                    stats.reconnect_attempts += reconnector.attempts
                stats.reconnects += 1
                try:
                    yield self._settle(first_offline, fresh, self._keeping(began))
                    if cut.heartbeat:
                        cut.heartbeat.revive()
                    return
                except (LinkDown, SessionLost) as exc:
                    stats.disconnects += 1
                    fresh = False
                    losses = losses + 1 if isinstance(exc, SessionLost) else 0
                    if losses >= SETTLE_LOSSES:  # it answers, and fails every session: not a link to wait out
                        raise SplitspecError(f"the server lost the session {losses} times in a row while settling "
                                             f"({exc}); giving up") from None  # fmt: skip
        finally:
            stats.offline_s += clock() - began

    def _emit(self, out: list[int], verified: list[bool]) -> tuple[list[int], list[bool]]:
        self.out, self.verified = out, verified
        return out, verified

    def _catch_up(self) -> None:
        """The tokens streamed since the last payload (a cut kept their features away) fed to the drafter again as
        offline tokens are — each after a proposal, so the drafter stands in its own features for the target's — so
        that it can generate after them; the target's own features replace those at the settlement."""
        start, end = self.unfeatured
        if start == 0:  # not even the prompt's arrived (a stream that opened the session): nothing to draft from
            return  # until the settlement fetches them
        tokens = (self.cut.prompt_ids + self.out)[start + 1 : end + 1]
        self.cut.drafter.rewind(len(tokens))
        self.cut.drafter.assume(tokens)

    def _keeping(self, began: float) -> bool:
        """Will the offline tokens be kept as they are (keep, or a cut past ``keep_after_s``) rather than verified?"""
        resilience = self.cut.resilience
        late = resilience.keep_after_s is not None and self.cut.clock() - began > resilience.keep_after_s
        return resilience.on_reconnect == "keep" or late

    def _generate_offline(self, reconnector: Reconnector, began: float) -> Iterator[tuple[list[int], list[bool]]]:
        """Offline tokens until the link is back: the drafter's own (or ``resilience.offline``'s, which reads the
        context first and whose tokens the drafter then takes as it takes its own, so the settlement goes as ever)."""
        cut, stats, clock = self.cut, self.stats, self.cut.clock
        resilience, drafter = cut.resilience, cut.drafter
        t0, survival, capped = clock(), 1.0, False
        writer = resilience.offline or drafter
        survival_of = cut.survival if writer is drafter else unmeasured  # (the policy measured the drafter)
        try:
            if writer is not drafter:
                writer.begin(cut.prompt_ids + self.out)
            while not reconnector.up.is_set():
                stopping = resilience.stop is not None and resilience.stop.is_set()
                if stopping or cut.finished(self.out, self.verified) or clock() - began > resilience.max_offline_s:
                    return
                if survival < resilience.offline_cap and not self._keeping(began):
                    stats.offline_capped += not capped  # the rest would almost surely be discarded: wait for the server
                    capped = True
                    reconnector.up.wait(0.05)
                    continue
                token, p = offline_draw(writer, cut.sampling, cut.generator)
                if token is None:  # nothing to offer offline (prompt lookup without a match): wait
                    reconnector.up.wait(0.05)
                    continue
                if writer is not drafter:
                    drafter.assume([token])
                survival *= survival_of(p)
                stats.offline_tokens += 1
                yield self._emit(self.out + [token], self.verified + [False])
        finally:
            stats.offline_gen_s += clock() - t0

    def _reopen(self, history: list[int]) -> list[int]:
        """A session opened again after ``prompt + history`` (its last token the root again): the tokens it adds."""
        cut = self.cut
        opened = cut.verifier.reopen(cut.prompt_ids + history, cut.sampling, spec=cut.spec)
        self.unfeatured = None  # the prefill brings the features of every cached token
        cut.drafter.begin(cut.prompt_ids + history + opened.new_tokens, opened.features)
        return opened.new_tokens

    def _settle(self, first_offline: int, fresh: bool, keep: bool) -> tuple[list[int], list[bool]]:
        """The history after reconnection: the offline tail kept (``keep``) or verified against the target."""
        cut, stats, out, verified = self.cut, self.stats, self.out, self.verified
        verifier, drafter = cut.verifier, cut.drafter
        tail = out[first_offline:]
        chunk = max(1, verifier.max_tree_nodes)  # settle in as few calls as the server allows
        if keep:
            opened = out + self._reopen(out)
            stats.offline_kept += len(tail)
            return self._emit(opened, verified[: len(out)] + [True] * (len(opened) - len(out)))
        if fresh:
            try:
                if self.unfeatured:  # a cut mid-stream kept the features of the last tokens away: fetch them first
                    drafter.absorb([], verifier.fetch(*self.unfeatured, cut.spec))
                    self.unfeatured = None
                replaced = settle_verify(verifier, drafter, tail, chunk, stats, cut.spec)
                stats.offline_kept += _agreed(tail, replaced)
                return self._emit(out[:first_offline] + replaced, verified[:first_offline] + [True] * len(replaced))
            except SessionLost:  # the server forgot us, or is out of step: reopen from what was verified
                pass
        history = out[:first_offline]
        opened = history[:-1] + self._reopen(history[:-1])
        if opened[-1] != history[-1]:  # (sampling) the target now picks another root: the tail goes
            return self._emit(opened, verified[: len(opened) - 1] + [True])
        for token in tail:
            drafter.absorb([token])
        replaced = settle_verify(verifier, drafter, tail, chunk, stats, cut.spec)
        stats.offline_kept += _agreed(tail, replaced)
        return self._emit(history + replaced, verified[:first_offline] + [True] * len(replaced))


def _wait_for_link(reconnector: Reconnector, seconds: float, stop: threading.Event | None,
                   clock: Callable[[], float] = time.perf_counter) -> bool:  # fmt: skip
    """Whether the link came back within ``seconds``; False at once when ``stop`` is set (the process is stopping:
    nobody will read what a settlement would give)."""
    deadline = clock() + max(0.0, seconds)
    while not (stop is not None and stop.is_set()):
        left = deadline - clock()
        if reconnector.up.wait(min(max(left, 0.0), STOP_POLL_S)):
            return True
        if left <= 0:
            return False
    return False


def _reachable(verifier: Verifier) -> bool:
    """One Handshake, given as long as a healthy link would need, so a dead one costs each poll little."""
    bound = verifier.link.timeout_s() if verifier.link is not None else None
    return verifier.reachable(timeout_s=max(MIN_POLL_S, 2 * bound + 0.1) if bound else 1.0)


def _agreed(tail: list[int], replaced: list[int]) -> int:
    """Offline tokens the target agreed with: the common prefix."""
    return next((i for i, (a, b) in enumerate(zip(tail, replaced, strict=False)) if a != b),
                min(len(tail), len(replaced)))  # fmt: skip


def offline_token(drafter: Drafter, sampling: SamplingParams = SamplingParams(),
                  generator: torch.Generator | None = None, width: int = 8) -> int | None:  # fmt: skip
    """The drafter's own next token, committed (unverified); None if it has nothing to offer.

    Greedy: its most likely token. Sampling: a draw, at the requested temperature and top-p, among
    the first level of its tree (at most ``width`` tokens, the drafter's own top-B): a truncated
    version of its distribution, which a tree drafter does not expose whole.
    """
    return offline_draw(drafter, sampling, generator, width)[0]


def offline_draw(drafter: Drafter, sampling: SamplingParams = SamplingParams(),
                 generator: torch.Generator | None = None, width: int = 8
                 ) -> tuple[int | None, float | None]:  # fmt: skip
    """``offline_token`` and the drafter's own probability of it (None: the drafter gives none, prompt lookup)."""
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


def settle_verify(verifier: Verifier, drafter: Drafter, tail: list[int], max_nodes: int, stats=None,
                     spec: PayloadSpec = NO_PAYLOAD) -> list[int]:  # fmt: skip
    """Verify the unverified offline ``tail`` (already absorbed by ``drafter``; ``spec``: the features it needs);
    return what replaces it.

    The result is the longest prefix of ``tail`` the target agrees with, then the target's own
    token where it first disagrees (or its token after the last offline one, when a chunk ended
    there; when the last offline token came back as the target's own choice, nothing is added). An empty tail is
    one plain round: its token, and the proof that the server still holds the session (a cut that made no offline
    token would otherwise go on with a session the server lost, and lose it again, for ever).
    The drafter is rewound and fed
    the target's features along the way, so it continues exactly as after an ordinary round.

    Chunks start at ``FIRST_CHUNK`` tokens and double while every token is kept, up to ``max_nodes``: an offline tail
    is mostly wrong early (the drafter alone drifts), and on a CPU a forward's cost grows with its tokens, so one
    forward over a long tail would pay for many tokens only to keep a few.
    """
    out: list[int] = []
    i, size = 0, min(FIRST_CHUNK, max(1, max_nodes))  # next offline token not yet verified; the next chunk's size
    while i < len(tail) or not out:
        chunk = tail[i : i + size]
        result = verifier.verify(DraftTree.chain(chunk), spec=spec)
        if stats is not None:
            stats.settle_calls += 1
        accepted, bonus = len(result.accepted), result.new_tokens[-1]
        out += chunk[:accepted]
        i += accepted
        if i < len(tail) and tail[i] == bonus:  # the target picks the next offline token too: go on from it
            drafter.absorb([], result.features)
            out.append(bonus)
            i += 1
            size = min(2 * size, max(1, max_nodes))
            continue
        drafter.rewind(len(tail) - i)
        drafter.absorb([bonus], result.features)
        out.append(bonus)
        return out
    return out
