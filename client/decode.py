"""The decode loop: one ``generate()`` for local, remote and link-failure-surviving generation.

Each round: the policy decides (a drafted round, a plain step, or a stretch the server decodes) → the
drafter proposes a tree → the policy sizes it (cuts the tree to what pays off, picks the payload spec) →
the verifier verifies → the drafter absorbs the kept tokens → they are emitted → the policy is told what
the round gained and cost. It knows nothing about which drafter proposes
or where verification happens; both are interfaces (``Drafter``, ``Verifier``).

Over a link, rounds are pipelined: while a Verify is in flight the drafter drafts ahead — it takes the tree's
likeliest path as accepted (``Drafter.assume``) and drafts the tree after it, whose first level holds its guesses
for the server's bonus token. When the verdict is that path and a bonus it guessed, the subtree under that bonus is
the next round's tree, ready at once: a round then costs the longer of drafting and the wire, not their sum. When
it is not, the guess is taken back (``rewind``) and the round goes on as it would have. Nothing the server sees
depends on the guess but which tree it verifies, so every output is as without it.

Instead of a round, the policy may have the server decode a stretch by itself (``Verifier.decode``,
server-side continuation): its tokens stream in with their payloads, the drafter absorbs them as they
come, so drafting can resume — or the link fail — at any token.

Losing the link is an event of this loop, not another loop: a Verify that fails for the link
(``LinkDown``; ``SessionLost``) hands over to ``client.offline.bridge``, which generates locally
(the drafter, with MoA's TLI layers) until the server answers again and then settles the
unverified tail (``verify``: the server checks it, greedy output ends as if never cut; ``keep``:
taken as is). ``fail`` ends the generation with an error naming the link instead.

Stats follow the MoA/EAGLE papers: acceptance length is the mean number of tokens gained per
verification round (accepted drafts + the bonus token); the prompt's prefill and reconciliation
calls are not rounds.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass, field, replace

import torch

from client import offline
from client.adaptive import AdaptivePolicy
from client.costs import verify_request_bytes
from client.drafters.base import Drafter
from client.failures import LinkDown, SessionLost
from client.heartbeat import Heartbeat
from client.sizing import outcomes
from client.verifiers import NO_PAYLOAD, Verifier, first_spec
from shared.acceptance import SamplingParams
from shared.errors import SplitspecError
from shared.payload import PayloadSpec
from shared.target import Verdict
from shared.tree import DraftTree, depths, path_to

ON_RECONNECT = ("verify", "keep", "fail")
MIN_DEADLINE_S = 0.1
DEADLINE_MARGIN_S = 0.05
UNMEASURED_RTT_S = 1.0  # stands in for SRTT + 4·RTTVAR before the link has been measured
# Tokens per payload while the server decodes: fewer, larger payloads cost the server less to make and compress
# better; a cut may keep the last (up to this many tokens') from arriving, and the settlement fetches them then.
PAYLOAD_EVERY = 8
OPEN_TRIES = 3  # a session lost as it opened (a replica died under it) is opened again, up to this many tries in all
AHEAD_NODES = 1.5  # a tree drafted ahead holds this many times a round's budget: its likeliest root's subtree is sent
HEDGES = 3  # outcomes a round drafts ahead for, the likeliest first, the others only while its verdict is not in
FLIGHT_GRACE_S = 2.0  # a Verify in flight is bounded by the verifier itself; this wait outlasts that bound
UNBOUNDED_FLIGHT_S = 300.0  # (no deadline: on_reconnect fail) the most a wait for a Verify in flight lasts


@dataclass
class Resilience:
    """What a generation does when the link fails (see the module docstring).

    ``max_offline_s`` bounds one stretch without the server; ``settle_wait_s`` bounds how long a
    generation already complete offline waits for the server to settle it (None: the rest of
    ``max_offline_s``; 0: return at once with the tail unverified). ``heartbeat`` probes the server
    on a connection of its own (``client.heartbeat``) so that a silent cut is noticed within about
    two round trips, not only at a Verify's deadline. ``keep_after_s``: under ``verify``, a cut that
    lasts longer keeps its local tokens as ``keep`` does (None: never). ``local_cap``: while local
    tokens are to be verified, local generation waits once the chance that all of them survive — the
    drafter's own probabilities, calibrated by its measured acceptance — falls below this (0: never
    waits): what comes after would almost surely be thrown away. ``stop``: set when the process is stopping
    (the edge on SIGTERM): a generation waiting for the link ends at once, its local tail unverified.
    ``offline``: the drafter that writes the local tokens (default None: the generation's own drafter) — a whole
    model (the 0.5B beside a MoA drafter), which writes text a long cut can keep; it reads the context at the cut.
    """

    on_reconnect: str = "verify"
    backoff: offline.Backoff = field(default_factory=offline.Backoff)
    max_offline_s: float = 600.0
    settle_wait_s: float | None = None
    heartbeat: bool = True
    keep_after_s: float | None = None
    local_cap: float = 0.05
    stop: threading.Event | None = None
    offline: Drafter | None = None

    def __post_init__(self) -> None:
        if self.on_reconnect not in ON_RECONNECT:
            raise ValueError(f"on_reconnect must be one of {', '.join(ON_RECONNECT)}, got {self.on_reconnect!r}")
        if self.keep_after_s is not None and not self.keep_after_s >= 0:
            raise ValueError(f"keep_after_s must be >= 0 seconds or None, got {self.keep_after_s!r}")
        if not 0 <= self.local_cap < 1:
            raise ValueError(f"local_cap must be a probability in [0, 1), got {self.local_cap!r}")


@dataclass
class GenerationStats:
    new_tokens: int = 0
    wall_s: float = 0.0
    tokens_per_s: float = 0.0
    rounds: int = 0  # verification rounds (prefill and reconciliation calls are not rounds)
    streamed_tokens: int = 0  # tokens the server decoded by itself (server-side continuation)
    streams: int = 0  # Decode calls
    server_calls: int = 0
    acceptance_length: float = 0.0  # tokens gained per verification round
    bytes_sent: int = 0
    bytes_received: int = 0
    payload_bytes: int = 0  # encoded feature payloads among bytes_received
    prefill_payload_bytes: int = 0  # the prompt's share of payload_bytes
    bytes_up_per_round: float = 0.0  # per server call
    bytes_down_per_round: float = 0.0
    bytes_down_per_token: float = 0.0  # per generated token
    payload_bytes_per_token: float = 0.0  # payloads of the rounds (not the prompt's) per generated token
    server_compute_s: float = 0.0
    ttft_s: float = 0.0
    draft_s: float = 0.0
    ahead_s: float = 0.0  # drafting ahead while a Verify was in flight (pipelined rounds)
    guesses: int = 0  # rounds that drafted ahead
    guesses_held: int = 0  # of which the verdict was the path guessed and a bonus guessed: the next tree was ready
    tree_nodes: list[int] = field(default_factory=list)  # nodes verified in each round
    rtt_ms: float | None = None  # the link as the client saw it at the end (None: no link, or not measured yet)
    bandwidth_mbps: float | None = None  # downlink, Mbit/s
    uplink_mbps: float | None = None
    # when the link failed: all zero in a generation it never did
    local_tokens: int = 0  # tokens generated without the server (kept or not)
    local_kept: int = 0  # of which the settlement kept (the server agreed with them, or they were kept as they are)
    local_capped: int = 0  # times local generation waited: what followed would almost surely have been thrown away
    disconnects: int = 0
    reconnects: int = 0
    reconnect_attempts: int = 0  # server polls while offline
    reconcile_calls: int = 0  # Verify calls that settled local tokens
    offline_s: float = 0.0  # from each detected failure to the settlement (or the end)
    local_s: float = 0.0  # of which spent generating local tokens
    switch_s: list[float] = field(default_factory=list)  # from the failing call's start to local generation
    switched_at: list[float] = field(default_factory=list)  # perf_counter() when local generation began
    heartbeat_probes: int = 0

    @property
    def local_tokens_per_s(self) -> float:
        return self.local_tokens / self.local_s if self.local_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(self).items()}


@dataclass
class Generation:
    token_ids: list[int]
    verified: list[bool]  # per token: did the server verify it (False only for local tokens left unsettled)
    finish_reason: str  # "stop" (a stop token), "length" (max_new_tokens) or "context" (window full)
    stats: GenerationStats
    spec: PayloadSpec = NO_PAYLOAD  # the payload its last call asked for


def generate(
    verifier: Verifier,
    drafter: Drafter,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    stop_ids: list[int] | None = None,
    max_tree_nodes: int = 64,
    policy: AdaptivePolicy | None = None,
    resilience: Resilience | None = None,
    on_update: Callable[[list[int], list[bool]], None] | None = None,
    stop_when: Callable[[list[int], list[bool]], bool] | None = None,
    spec: PayloadSpec | None = None,
    pipeline: bool | None = None,
) -> Generation:
    """Generate up to ``max_new_tokens`` with ``drafter`` proposing and ``verifier`` deciding.

    ``policy`` (``client.adaptive.AdaptivePolicy``) drafts each round's tree to its depth, cuts it to
    the size it expects to pay off and picks the payload spec; without one every round verifies the
    drafter's whole tree of at most ``max_tree_nodes``. ``resilience`` (default ``Resilience()``:
    survive, then verify) says what happens when the link fails. ``on_update(tokens, verified)`` sees
    the whole output after every change: tokens made offline appear unverified and may be replaced
    when the server is back (``verify``) — a stream prints what is verified, or everything under ``keep``.
    ``stop_when(tokens, verified)``: the generation ends ("stop") once it says so (a stop sequence in the text).
    ``spec``: the payload to start with (default: the first the drafter takes that the verifier can send).
    ``pipeline``: draft the next tree while a Verify is in flight (default: over a link; in process the target and
    the drafter would share the same cores).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    stop = set(verifier.eos_token_ids if stop_ids is None else stop_ids)
    run = Run(verifier=verifier, drafter=drafter, prompt_ids=list(prompt_ids), limit=max_new_tokens, sampling=sampling,
              stop=stop, policy=policy, max_nodes=max_tree_nodes, resilience=resilience or Resilience(),
              on_update=on_update, stop_when=stop_when, spec=spec_for(verifier, drafter, spec),
              pipeline=verifier.link is not None if pipeline is None else pipeline)  # fmt: skip
    return run.generate()


def spec_for(verifier: Verifier, drafter: Drafter, wanted: PayloadSpec | None) -> PayloadSpec:
    """The payload spec to open with: ``wanted`` if the drafter can use it, else the drafter's first usable."""
    needs = drafter.payload_specs()
    usable = verifier.usable(needs)
    if wanted and wanted.mode not in {s.mode for s in needs}:
        takes = ", ".join(sorted({s.mode for s in needs})) or "none"
        raise SplitspecError(f"drafter {drafter.name} cannot use payload mode {wanted.mode!r}; it takes {takes}")
    if needs and not usable:
        raise SplitspecError(
            f"drafter {drafter.name} needs payload "
            f"{' or '.join(sorted({s.mode for s in needs}))}, which this verifier cannot send"
        )
    return wanted or first_spec(verifier, needs)


class Run:
    """One generation's state: the output, which of it is verified, the payload it asks for, the stats, and the
    link's running estimates."""

    def __init__(self, *, verifier: Verifier, drafter: Drafter, prompt_ids: list[int], limit: int,
                 sampling: SamplingParams, stop: set[int], policy: AdaptivePolicy | None, max_nodes: int,
                 resilience: Resilience, on_update: Callable[[list[int], list[bool]], None] | None = None,
                 stop_when: Callable[[list[int], list[bool]], bool] | None = None,
                 spec: PayloadSpec = NO_PAYLOAD, pipeline: bool = False) -> None:  # fmt: skip
        self.verifier, self.drafter, self.prompt_ids, self.limit = verifier, drafter, prompt_ids, limit
        self.sampling, self.stop, self.policy, self.max_nodes = sampling, stop, policy, max_nodes
        self.resilience, self.on_update, self.stop_when = resilience, on_update, stop_when
        self.spec = spec  # the features each call asks for: the policy may choose another per call
        self.stats = GenerationStats()
        self.out: list[int] = []
        self.verified: list[bool] = []
        self.gained = 0
        self.heartbeat: Heartbeat | None = None
        self.generator = torch.Generator().manual_seed(sampling.seed)  # offline sampling: reproducible per seed
        # running estimates of one verification, for its deadline
        self.verify_s, self.reply_bytes = 0.0, 0.0
        self.unfeatured: tuple[int, int] | None = None  # cached tokens whose features a cut mid-stream kept away
        self.pipeline = pipeline
        self.flights: ThreadPoolExecutor | None = None  # where a pipelined round's Verify waits for its verdict
        self.ready: DraftTree | None = None  # the next round's tree, drafted while the last one was verified

    def generate(self) -> Generation:
        """prompt → prefill → {decide → (stream | draft → size → verify → accept → absorb) → emit} → text; a link
        that fails hands over to the offline stage (``client.offline.bridge``) and the loop goes on after it."""
        verifier, policy, stats = self.verifier, self.policy, self.stats
        before = replace(verifier.counters)
        start = time.perf_counter()
        if verifier.link is not None and self.resilience.heartbeat and self.resilience.on_reconnect != "fail":
            self.heartbeat = Heartbeat(verifier.endpoint, verifier.link, busy=lambda: verifier.busy,
                                       heard=verifier.heard, backlog_s=verifier.backlog_s)  # fmt: skip
            self.heartbeat.on_dead(verifier.abort)
        reason = ""
        if policy is not None and (spec := policy.prompt_spec(len(self.prompt_ids))):
            self.spec = spec  # sized for the link: the prompt's features are the largest payload
        opens = 0  # tries to open the session
        if self.pipeline:
            self.flights = ThreadPoolExecutor(1, thread_name_prefix="splitspec-verify")
        if policy is not None:
            policy.pipelines(self.pipeline)
        try:
            # the session is opened first, whatever the prompt: one that fills the context is refused there, clearly
            while not self.out or not (reason := self.finished()):
                call = time.perf_counter()
                try:
                    if policy is not None and (stretch := policy.stretch()):
                        self.ready = None  # the stream moves the drafter on: a tree drafted ahead is stale
                        # a stretch that starts the generation opens the session in the same call
                        self.continuation(stretch, start if not self.out else None)
                    elif not self.out:  # the prefill: its compute is the first guess at a round's
                        self.verify_s = self.open([]).compute_s
                        self.started(start)
                    else:
                        self.round()
                except (LinkDown, SessionLost) as exc:
                    if not self.out:  # the session never opened: a server that answered and lost it as it opened
                        opens += 1  # (a replica gone) is asked again, a few times; an unreachable one is an error
                        retry = isinstance(exc, SessionLost) and self.resilience.on_reconnect != "fail"
                        if retry and opens < OPEN_TRIES:
                            continue
                        raise
                    if self.resilience.on_reconnect == "fail":
                        raise SplitspecError(f"the link failed ({exc}); not generating without the server "
                                             "(on_reconnect fail)") from None  # fmt: skip
                    stats.disconnects += 1
                    stats.switch_s.append(time.perf_counter() - call)
                    self.ready = None
                    offline.bridge(self)
        finally:
            if self.flights is not None:
                self.flights.shutdown(wait=False)  # its one call is over (answered, or lost and bounded)
            if self.heartbeat:
                self.heartbeat.close()
                stats.heartbeat_probes = self.heartbeat.probes
            try:
                verifier.close(timeout_s=1.0, wait=False)  # its answer would cost a round trip for nothing
            except SplitspecError:  # the link may be down for good: the server's TTL frees the session
                pass
        stats.new_tokens, stats.wall_s = len(self.out), time.perf_counter() - start
        stats.tokens_per_s = len(self.out) / stats.wall_s
        stats.acceptance_length = self.gained / stats.rounds if stats.rounds else 0.0
        copy_link_stats(stats, verifier, before)
        return Generation(self.out, self.verified, reason, stats, self.spec)

    def started(self, start: float) -> None:
        """The first token is in (``start``: when the generation began)."""
        self.stats.ttft_s = time.perf_counter() - start
        if self.heartbeat:
            self.heartbeat.start()  # the first call gave the link an RTT estimate to set its deadline from

    def round(self) -> None:
        """Decide, draft, size, verify, accept, absorb, emit: one verification round."""
        verifier, drafter, policy, stats = self.verifier, self.drafter, self.policy, self.stats
        t0 = time.perf_counter()
        drafting = policy is None or policy.drafts()
        ready, self.ready = self.ready, None
        if drafting and ready is not None:
            tree = ready.head(self.budget())  # drafted while the last round was verified (with room to spare)
        elif drafting:
            tree = drafter.propose(self.budget(), policy.depth if policy is not None else None)
        else:
            tree = DraftTree()  # a plain step: drafting has not been paying
        draft_s = time.perf_counter() - t0
        stats.draft_s += draft_s
        # the levels a search drafted each cost a step (a tree with no scores is a copy: prompt lookup, free; a
        # tree drafted ahead was paid for during the last round)
        levels = max(depths(tree.parents), default=0) if tree.scores is not None and ready is None else 0
        decision = None
        if policy is not None:
            self.spec = policy.round_spec() or self.spec
            decision = policy.size(tree, self.spec)
            tree = tree.head(decision.nodes)
        self.check_heartbeat()
        received = verifier.counters.bytes_received
        if self.pipeline and drafting:
            result = self.pipelined(tree)
        else:
            result = verifier.verify(tree, timeout_s=self.deadline(len(tree)), spec=self.spec)
            drafter.absorb(result.new_tokens, result.features)
        compute = max(result.compute_s, 0.0)
        self.verify_s = max(compute, 0.8 * self.verify_s + 0.2 * compute)  # up at once, down slowly
        self.reply_bytes = 0.8 * self.reply_bytes + 0.2 * (verifier.counters.bytes_received - received)
        if result.verified_nodes is not None and result.verified_nodes < len(tree):
            tree = tree.head(result.verified_nodes)  # the server verified only these
        stats.rounds += 1
        stats.tree_nodes.append(len(tree))
        self.gained += len(result.new_tokens)
        self.commit(self.out + result.new_tokens, self.verified + [True] * len(result.new_tokens))
        if policy is not None:
            policy.loaded(result.load)
            policy.rounded(decision, tree, len(result.accepted), len(result.new_tokens), result.compute_s, draft_s,
                           levels, time.perf_counter() - t0, drafting)  # fmt: skip

    def pipelined(self, tree: DraftTree) -> Verdict:
        """Verify ``tree`` while drafting ahead of its verdict, for its likeliest outcomes in turn (the first always,
        the next ones while the verdict is not in); the drafter ends having absorbed the verdict, and ``self.ready``
        holds the next tree when one of the guesses held."""
        drafter, stats = self.drafter, self.stats
        deadline = self.deadline(len(tree))
        flight = self.flights.submit(self.verifier.verify, tree, timeout_s=deadline, spec=self.spec)
        t0 = time.perf_counter()
        depth = self.depth()  # one level more: the first holds the guesses for the bonus
        depth, size = None if depth is None else depth + 1, max(1, round(AHEAD_NODES * self.budget()))
        aheads: list[tuple[list[int], DraftTree]] = []  # (a path guessed accepted, the tree drafted after it)
        calibration = self.policy.calibration if self.policy is not None else 1.0
        for leaf, _ in outcomes(tree, calibration, self.sampling.temperature == 0)[:HEDGES]:
            if aheads and flight.done():
                break
            path = [tree.tokens[i] for i in path_to(tree.parents, leaf)] if leaf >= 0 else []
            drafter.assume(path)
            aheads.append((path, drafter.propose(size, depth)))
            drafter.discard()  # verified, if at all, as the next round's tree
            drafter.rewind(len(path))
        ahead_s = time.perf_counter() - t0
        stats.ahead_s += ahead_s
        stats.guesses += 1
        try:
            result = flight.result(timeout=(deadline or UNBOUNDED_FLIGHT_S) + FLIGHT_GRACE_S)
        except FutureTimeout:
            raise LinkDown(f"server {self.verifier.address}: a Verify unanswered past its bound") from None
        drafter.absorb(result.new_tokens, result.features)
        bonus, ready = result.new_tokens[-1], None
        taken = next((ahead for path, ahead in aheads if result.new_tokens[:-1] == path), None)
        if taken is not None:
            first = next((i for i, (t, p) in enumerate(zip(taken.tokens, taken.parents, strict=True))
                          if p == -1 and t == bonus), None)  # fmt: skip
            ready = taken.subtree(first) if first is not None else None
        if self.policy is not None:
            self.policy.ahead(taken is not None, bool(ready), ahead_s)
        if ready:  # (an empty one is no guess: the drafter stopped at the bonus's level, unsure of it)
            self.ready = ready
            stats.guesses_held += 1
        return result

    def depth(self) -> int | None:
        """How deep the next tree is drafted (None: the drafter's own depth)."""
        return self.policy.depth if self.policy is not None else None

    def budget(self) -> int:
        """The most tree nodes a round may send now."""
        room = self.verifier.max_context - len(self.prompt_ids) - len(self.out)
        return max(0, min(self.max_nodes, self.verifier.max_tree_nodes, room - 1))

    def check_heartbeat(self) -> None:
        """LinkDown if the heartbeat has found the server gone: no call is worth starting."""
        if self.heartbeat and self.heartbeat.dead.is_set():
            raise LinkDown(f"server {self.verifier.address}: {self.heartbeat.reason}")

    def continuation(self, stretch: int, opening: float | None = None) -> None:
        """Server-side continuation: a stretch of ``stretch`` tokens decoded by the server alone (a Decode stream),
        absorbed and emitted as they arrive. The server is asked for all the generation has left, so that the policy
        may extend the stretch without a new call (``extend``);
        the stream is cancelled when the stretch ends, or once the generation is finished (a stop string).
        ``opening``: the session is opened by this stream (the time the generation began)."""
        verifier, drafter, policy, stats = self.verifier, self.drafter, self.policy, self.stats
        room = verifier.max_context - len(self.prompt_ids) - len(self.out)
        limit = min(self.limit - len(self.out), room)
        self.check_heartbeat()
        self.spec = policy.stream_spec() or self.spec
        spec, stop = self.spec, sorted(self.stop)
        t0, got, compute = time.perf_counter(), 0, 0.0
        stats.streams += 1
        if opening is None:
            tokens = verifier.decode(limit, stop, PAYLOAD_EVERY, lookup=policy.lookup, spec=spec)
            featured = cached = len(self.prompt_ids) + len(self.out) - 1  # the server caches all but the root
        else:  # the prompt's features come with the first payload
            tokens = verifier.open_decode(self.prompt_ids, self.sampling, limit, stop, PAYLOAD_EVERY,
                                          lookup=policy.lookup, spec=spec)  # fmt: skip
            featured, cached = 0, len(self.prompt_ids) - 1
        rehearsal = None  # (a tree drafted and not sent, its depth, where its root is in the output, seconds drafting)
        try:
            with contextlib.closing(tokens):
                for result in tokens:
                    if opening is not None and not self.out:
                        drafter.begin(self.prompt_ids + result.new_tokens, result.features)
                        self.started(opening)
                        stretch += 1  # the prefill's token: every mode waits for it, so it does not time the stream
                        t0, got, compute = time.perf_counter(), -1, -result.compute_s
                    else:
                        drafter.absorb(result.new_tokens, result.features)
                    cached += len(result.new_tokens)
                    if result.features is not None:
                        featured = result.features.start + len(result.features)
                    got, compute = got + len(result.new_tokens), compute + result.compute_s
                    # a streamed token's time on a loaded server (its batch's forward) bounds a Verify's from below
                    self.verify_s = max(result.compute_s, 0.8 * self.verify_s + 0.2 * result.compute_s)
                    stats.streamed_tokens += len(result.new_tokens)
                    self.commit(self.out + result.new_tokens, self.verified + [True] * len(result.new_tokens))
                    policy.loaded(result.load)
                    if self.finished():
                        break
                    rehearsal = self.rehearse(rehearsal, featured == cached or not spec)
                    # the stretch is over once its features are in too (a payload comes every PAYLOAD_EVERY tokens;
                    # ending between two would leave the drafter without the last ones): told, then maybe extended
                    if got >= stretch and (featured == cached or not spec):
                        policy.streamed(got, compute, time.perf_counter() - t0)
                        t0, got, compute = time.perf_counter(), 0, 0.0
                        if not (stretch := policy.extend()):
                            break
        except (LinkDown, SessionLost):
            if featured < cached and spec:
                self.unfeatured = (featured, cached)  # fetched when the server is back (client.offline)
            raise
        policy.streamed(got, compute, time.perf_counter() - t0)

    def rehearse(self, rehearsal, featured: bool):
        """Drafting rehearsed during a stream (``client.schedule``): a tree drafted from the newest token once the
        drafter has every feature (``featured``), never sent, scored once the tokens its depth reaches have streamed
        in. Returns the rehearsal under way (None: none)."""
        drafter, policy = self.drafter, self.policy
        if rehearsal is not None:
            tree, depth, at, draft_s = rehearsal
            if len(self.out) - (at + 1) <= depth:  # (checked at every chunk: no copy of the output until then)
                return rehearsal
            policy.rehearsed(tree, tree.follow(self.out[at + 1 :]), draft_s)
        if not featured or not policy.rehearse():
            return None
        t0 = time.perf_counter()
        tree = drafter.propose(self.budget(), policy.depth)
        drafter.discard()
        depth = max(depths(tree.parents), default=0)  # (an empty tree counts: a round that gains one)
        return tree, depth, len(self.out) - 1, time.perf_counter() - t0

    def deadline(self, nodes: int) -> float | None:
        """How long a Verify may take before the link is presumed dead: the RTT bound (SRTT + 4·RTTVAR), the
        server's expected compute with headroom (the larger of the recent rounds' and what the policy's cost curve
        says a tree this size takes), the transfers at the measured rates, a margin. None: no link, or nothing to
        fall back on (``fail``: a deadline could only turn a slow reply into a failed generation)."""
        link = self.verifier.link
        if link is None or self.resilience.on_reconnect == "fail":
            return None
        rtt = link.timeout_s()
        transfer = link.transfer_s(verify_request_bytes(nodes), int(2 * self.reply_bytes))
        rtt = UNMEASURED_RTT_S if rtt is None else rtt
        compute = max(self.verify_s, self.policy.verify_estimate(nodes) if self.policy is not None else 0.0)
        return max(MIN_DEADLINE_S, rtt + 1.5 * compute + transfer + DEADLINE_MARGIN_S)

    def open(self, history: list[int]) -> Verdict:
        """(Re)open a session after ``prompt + history`` (the last token of ``history`` becomes the root again) and
        return its round: the server's next token in ``new_tokens``, the prefill's compute. ``self.out`` gains that
        token when ``history`` is empty (the first opening); a reopening's caller decides what the output becomes."""
        verifier = self.verifier
        try:
            verifier.close(timeout_s=2.0)  # the old session, if the server still has it
        except SplitspecError:
            pass
        opened = verifier.open(self.prompt_ids + history, self.sampling, spec=self.spec)
        self.unfeatured = None  # the prefill brings the features of every cached token
        self.drafter.begin(self.prompt_ids + history + opened.new_tokens, opened.features)
        if not history:
            self.commit(opened.new_tokens, [True] * len(opened.new_tokens))
        return opened

    def commit(self, out: list[int], verified: list[bool]) -> None:
        """The output is now ``out``, cut after its first stop token and at the token budget; tell ``on_update``."""
        end = next((i + 1 for i, t in enumerate(out) if t in self.stop), len(out))
        end = min(end, self.limit)
        self.out, self.verified = out[:end], verified[:end]
        if self.on_update:
            self.on_update(self.out, self.verified)

    def finished(self) -> str:
        if self.out and self.out[-1] in self.stop:
            return "stop"
        if self.stop_when is not None and self.stop_when(self.out, self.verified):
            return "stop"
        if len(self.out) >= self.limit:
            return "length"
        if len(self.prompt_ids) + len(self.out) >= self.verifier.max_context:
            return "context"
        return ""


def verified_prefix(verified: list[bool]) -> int:
    """How many leading tokens the server has verified: what a stream may show under ``verify``."""
    return next((i for i, v in enumerate(verified) if not v), len(verified))


def api_generate(
    remote,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    stop_ids: list[int] | None = None,
    on_update: Callable[[list[int], list[bool]], None] | None = None,
) -> Generation:
    """The API baseline: the server decodes alone and streams tokens; no drafts, one call."""
    stop = list(remote.eos_token_ids if stop_ids is None else stop_ids)
    stats = GenerationStats()
    before = replace(remote.counters)
    start = time.perf_counter()
    out: list[int] = []
    reason = "length"
    for tokens in remote.api_tokens(list(prompt_ids), sampling, max_new_tokens, stop):
        if not out:
            stats.ttft_s = time.perf_counter() - start
        out += tokens
        if on_update:
            on_update(out, [True] * len(out))
        if tokens and tokens[-1] in stop:
            reason = "stop"
    stats.wall_s = time.perf_counter() - start
    stats.new_tokens = len(out)
    stats.tokens_per_s = len(out) / stats.wall_s
    stats.rounds = len(out)
    stats.acceptance_length = 1.0
    copy_link_stats(stats, remote, before)
    return Generation(out, [True] * len(out), reason, stats)


def copy_link_stats(stats: GenerationStats, verifier: Verifier, before) -> None:
    """What this generation cost the link (counters since ``before``) and the verifier's latest link estimates."""
    counters = verifier.counters.since(before)
    stats.server_calls = counters.server_calls
    stats.bytes_sent = counters.bytes_sent
    stats.bytes_received = counters.bytes_received
    stats.payload_bytes = counters.payload_bytes
    stats.prefill_payload_bytes = counters.prefill_payload_bytes
    calls = max(counters.server_calls, 1)
    stats.bytes_up_per_round = counters.bytes_sent / calls
    stats.bytes_down_per_round = counters.bytes_received / calls
    stats.bytes_down_per_token = counters.bytes_received / max(stats.new_tokens, 1)
    stats.payload_bytes_per_token = (stats.payload_bytes - stats.prefill_payload_bytes) / max(stats.new_tokens, 1)
    stats.server_compute_s = counters.server_compute_s
    if verifier.link is not None:
        for name, value in verifier.link.as_stats().items():
            setattr(stats, name, value)
