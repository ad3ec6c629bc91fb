"""The decode loop: one ``generate()`` for local, remote and link-failure-surviving generation.

Each round: the policy decides (a drafted round, a plain step, or a stretch the server decodes) → the
drafter proposes a tree → the policy sizes it (cuts the tree to what pays off, picks the payload spec) →
the verifier verifies → the drafter absorbs the kept tokens → they are emitted → the policy is told what
the round gained and cost. It knows nothing about which drafter proposes
or where verification happens; both are interfaces (``Drafter``, ``Verifier``).

Over a link, rounds are pipelined: while a Verify is in flight the drafter drafts ahead of its verdict, and the tree
drafted for the likeliest outcome may be sent before it, chained (``client.loop.ahead``). Nothing the server sees
depends on a guess but which tree it verifies, so every output is as without it. Instead of a round, the policy may
have the server decode a stretch by itself, streamed, the drafter absorbing its tokens as they come
(``client.loop.stretch``), so drafting can resume, or the link fail, at any token.

Losing the link is an event of this loop, not another loop: a Verify that fails for the link
(``LinkDown``; ``SessionLost``) hands over to ``client.loop.offline.Bridge``, which generates offline
(the drafter, with MoA's TLI layers) until the server answers again and then settles the
unverified tail (``verify``: the server checks it, greedy output ends as if never cut; ``keep``:
taken as is); the loop applies what it yields, as it applies a round's tokens, through its one writer
(``Run.commit``). ``fail`` ends the generation with an error naming the link instead.

Stats follow the MoA/EAGLE papers: acceptance length is the mean number of tokens gained per
verification round (accepted drafts + the bonus token); the prompt's prefill and settlement
calls are not rounds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass, field, replace
from typing import TypeVar

import torch

from client.drafters.base import Drafter
from client.loop import ahead, stretch
from client.loop.adaptive import Loaded, Pipelining, Plan, Policy, Round, State, StaticPolicy
from client.loop.ahead import FLIGHT_GRACE_S, UNBOUNDED_FLIGHT_S, Chained
from client.loop.costs import verify_request_bytes
from client.loop.offline import Bridge, Cut, OfflineStats, Resilience
from client.net.connection import LinkCounters
from client.net.deadlines import round_s
from client.net.failures import LinkDown, SessionLost, Stale
from client.net.heartbeat import Heartbeat
from client.verifiers import NO_PAYLOAD, Verifier, first_spec
from shared.acceptance import SamplingParams
from shared.engine.target import Verdict
from shared.errors import SplitspecError
from shared.payload import PayloadSpec
from shared.tree import DraftTree, depths

T = TypeVar("T")  # what the call that opens a session returns (``Run.beside_prepare``)
OPEN_TRIES = 3  # a session lost as it opened (a replica died under it) is opened again, up to this many tries in all


@dataclass
class GenerationStats(OfflineStats):
    """What a generation did and cost (with ``OfflineStats``: what its link's failures cost)."""

    new_tokens: int = 0
    wall_s: float = 0.0
    tokens_per_s: float = 0.0
    rounds: int = 0  # verification rounds (prefill and settlement calls are not rounds)
    streamed_tokens: int = 0  # tokens the server decoded by itself (streams)
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
    reused_tokens: int = 0  # prompt tokens the opening took from the server's (or ``--local``'s) prefix cache
    ttft_s: float = 0.0
    draft_s: float = 0.0
    ahead_s: float = 0.0  # drafting ahead while a Verify was in flight (pipelined rounds)
    rehearse_s: float = 0.0  # drafting trees never sent while a stream ran (mode auto's rehearsals)
    guesses: int = 0  # rounds that drafted ahead
    guesses_held: int = 0  # of which the verdict was the path guessed and a bonus guessed: the next tree was ready
    chained: int = 0  # rounds sent before the verdict of the one before (chained)
    chained_held: int = 0  # of which that verdict was the one assumed: the round was under way when it came
    tree_nodes: list[int] = field(default_factory=list)  # nodes verified in each round
    rtt_ms: float | None = None  # the link as the client saw it at the end (None: no link, or not measured yet)
    bandwidth_mbps: float | None = None  # downlink, Mbit/s
    uplink_mbps: float | None = None
    heartbeat_probes: int = 0

    @property
    def offline_tokens_per_s(self) -> float:
        return self.offline_tokens / self.offline_gen_s if self.offline_gen_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(self).items()}


@dataclass
class Generation:
    token_ids: list[int]
    verified: list[bool]  # per token: did the server verify it (False only for offline tokens left unsettled)
    finish_reason: str  # "stop" (a stop token), "length" (max_new_tokens) or "context" (window full)
    stats: GenerationStats
    spec: PayloadSpec = NO_PAYLOAD  # the payload its last call asked for


@dataclass(frozen=True)
class Settings:
    """How one generation runs, besides what it generates from (see ``generate``).

    ``policy`` (``client.loop.adaptive.AdaptivePolicy``) drafts each round's tree to its depth, cuts it to the size it
    expects to pay off and picks the payload spec; by default (``StaticPolicy``) every round verifies the drafter's
    whole tree of at most ``max_tree_nodes``. ``resilience`` (default ``Resilience()``: survive, then verify) says
    what happens when the link fails. ``stop_ids``: the tokens that end a generation (default: the target's
    end-of-sequence tokens). ``stop_when(tokens, verified)``: the generation ends ("stop") once it says so (a stop
    sequence in the text). ``spec``: the payload to start with (default: the first the drafter takes that the
    verifier can send). ``pipeline``: draft the next tree while a Verify is in flight (default: over a link; in
    process the target and the drafter would share the same cores). ``chain``: pipelined rounds also send the tree
    drafted ahead before the verdict it assumes, where the verifier takes it (``Verifier.chains``; default on).
    ``clock``: seconds, for every time the loop measures or bounds.
    """

    sampling: SamplingParams = SamplingParams()
    stop_ids: list[int] | tuple[int, ...] | None = None
    max_tree_nodes: int = 64
    policy: Policy | None = None
    resilience: Resilience | None = None
    stop_when: Callable[[list[int], list[bool]], bool] | None = None
    spec: PayloadSpec | None = None
    pipeline: bool | None = None
    chain: bool = True
    clock: Callable[[], float] = time.perf_counter


def generate(verifier: Verifier, drafter: Drafter, prompt_ids: list[int], max_new_tokens: int,
             settings: Settings = Settings(),
             on_update: Callable[[list[int], list[bool]], None] | None = None) -> Generation:  # fmt: skip
    """Generate up to ``max_new_tokens`` with ``drafter`` proposing and ``verifier`` deciding, as ``settings`` say.
    ``on_update(tokens, verified)`` sees the whole output after every change: tokens made offline appear unverified
    and may be replaced when the server is back (``verify``); a stream prints what is verified, or everything under
    ``keep``."""
    s = settings
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    stop = set(verifier.eos_token_ids if s.stop_ids is None else s.stop_ids)
    run = Run(verifier=verifier, drafter=drafter, prompt_ids=list(prompt_ids), limit=max_new_tokens,
              sampling=s.sampling, stop=stop, policy=s.policy or StaticPolicy(), max_nodes=s.max_tree_nodes,
              resilience=s.resilience or Resilience(), on_update=on_update, stop_when=s.stop_when,
              spec=spec_for(verifier, drafter, s.spec), clock=s.clock,
              pipeline=verifier.link is not None if s.pipeline is None else s.pipeline, chain=s.chain)  # fmt: skip
    return run.generate()


def spec_for(verifier: Verifier, drafter: Drafter, wanted: PayloadSpec | None) -> PayloadSpec:
    """The payload spec to open with: ``wanted`` if the drafter can use it, else the drafter's first usable."""
    needs = drafter.payload_specs()
    usable = verifier.usable(needs)
    if wanted and wanted.form not in {s.form for s in needs}:
        takes = ", ".join(sorted({s.form for s in needs})) or "none"
        raise SplitspecError(f"drafter {drafter.name} cannot use payload form {wanted.form!r}; it takes {takes}")
    if needs and not usable:
        raise SplitspecError(
            f"drafter {drafter.name} needs payload "
            f"{' or '.join(sorted({s.form for s in needs}))}, which this verifier cannot send"
        )
    return wanted or first_spec(verifier, needs)


class Run:
    """One generation's state: the output, which of it is verified, the payload it asks for, the stats, and the
    link's running estimates."""

    def __init__(self, *, verifier: Verifier, drafter: Drafter, prompt_ids: list[int], limit: int,
                 sampling: SamplingParams, stop: set[int], policy: Policy, max_nodes: int,
                 resilience: Resilience, on_update: Callable[[list[int], list[bool]], None] | None = None,
                 stop_when: Callable[[list[int], list[bool]], bool] | None = None,
                 spec: PayloadSpec = NO_PAYLOAD, pipeline: bool = False, chain: bool = False,
                 clock: Callable[[], float] = time.perf_counter) -> None:  # fmt: skip
        self.verifier, self.drafter, self.prompt_ids, self.limit = verifier, drafter, prompt_ids, limit
        self.sampling, self.stop, self.policy, self.max_nodes = sampling, stop, policy, max_nodes
        self.resilience, self.on_update, self.stop_when = resilience, on_update, stop_when
        self.spec = spec  # the features each call asks for: the policy may choose another per call
        self.stats = GenerationStats()
        self.before = LinkCounters()  # the verifier's counters when the generation began
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
        self.chain = pipeline and chain and verifier.chains
        self.chained: Chained | None = None  # the next round, sent before the last one's verdict, which it assumed
        self.plan = Plan()  # the policy's answer for the call under way
        self.clock = clock

    def generate(self) -> Generation:
        """prompt → prefill → {plan → (stream | draft → size → verify → accept → absorb) → emit} → text; a link that
        fails hands over to the offline stage (``client.loop.offline.Bridge``) and the loop goes on after it."""
        verifier, policy, stats, clock = self.verifier, self.policy, self.stats, self.clock
        before = self.before = replace(verifier.counters)
        start = clock()
        c = verifier.connection
        if c is not None and self.resilience.heartbeat and self.resilience.on_reconnect != "fail":
            self.heartbeat = Heartbeat(c.endpoint, c.link, busy=lambda: c.busy, heard=c.heard, backlog_s=c.backlog_s)
            self.heartbeat.on_dead(c.abort)
        reason = ""
        opens = 0  # tries to open the session
        if self.pipeline or verifier.link is not None:  # (a server's prefill beside the drafter's too: ``open``)
            self.flights = ThreadPoolExecutor(1, thread_name_prefix="splitspec-verify")  # (a chained call: no thread)
        policy.observe(Pipelining(self.pipeline, self.chain))
        try:
            # the session is opened first, whatever the prompt: one that fills the context is refused there, clearly
            while not self.out or not (reason := self.finished()):
                call = clock()
                if self.chained is None:  # (a round under way is the next call, as the plan it was sent under said)
                    self.plan = policy.plan(State(len(self.prompt_ids), len(self.out)))
                    self.spec = self.plan.spec or self.spec  # the prompt's features are the largest payload: sized too
                try:
                    if self.plan.stream:
                        self.ready = None  # the stream moves the drafter on: a tree drafted ahead is stale
                        # a stretch that starts the generation opens the session in the same call
                        stretch.stream(self, self.plan.stream, start if not self.out else None)
                    elif not self.out:  # the prefill: its compute is the first guess at a round's
                        self.verify_s = self.open(start).compute_s
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
                    stats.switch_s.append(clock() - call)
                    self.ready = self.chained = None  # (a chained call failing is what raised; one after it is dropped)
                    self.bridge()
        finally:
            if self.chained is not None:  # the generation ended with a round under way: not wanted
                self.chained.pending.drop()
            if self.flights is not None:
                self.flights.shutdown(wait=False)  # its one call is over (answered, or lost and bounded)
            if self.heartbeat:
                self.heartbeat.close()
                stats.heartbeat_probes = self.heartbeat.probes
            try:
                verifier.close(timeout_s=1.0, wait=False)  # its answer would cost a round trip for nothing
            except SplitspecError:  # the link may be down for good: the server's TTL frees the session
                pass
        stats.new_tokens, stats.wall_s = len(self.out), clock() - start
        stats.tokens_per_s = len(self.out) / stats.wall_s if stats.wall_s > 0 else 0.0
        stats.acceptance_length = self.gained / stats.rounds if stats.rounds else 0.0
        copy_link_stats(stats, verifier, before)
        return Generation(self.out, self.verified, reason, stats, self.spec)

    def bridge(self) -> None:
        """The link failed: the offline stage runs on what the generation holds, and each output it yields is
        applied here, as a round's is; then what it cost and what is still unfetched."""
        bridge = Bridge(Cut(self.verifier, self.drafter, self.resilience, self.prompt_ids, self.out, self.verified,
                            self.finished_with, self.sampling, self.generator, self.spec, self.unfeatured,
                            self.policy.survival, self.heartbeat, self.clock))  # fmt: skip
        try:
            for out, verified in bridge.outputs():
                self.commit(out, verified)
        finally:
            self.unfeatured = bridge.unfeatured
            self.stats.add(bridge.stats)

    def started(self, start: float) -> None:
        """The first token is in (``start``: when the generation began)."""
        self.stats.ttft_s = self.clock() - start
        self.stats.reused_tokens = self.verifier.counters.reused_tokens - self.before.reused_tokens  # (not reopens')
        if self.heartbeat:
            self.heartbeat.start()  # the first call gave the link an RTT estimate to set its deadline from

    def round(self) -> None:
        """Draft, size, verify, accept, absorb, emit: one verification round, as ``self.plan`` says (or the round sent
        chained during the last one, ``self.chained``)."""
        verifier, drafter, policy, stats, clock = self.verifier, self.drafter, self.policy, self.stats, self.clock
        t0 = clock()
        chained, self.chained = self.chained, None
        drafting = self.plan.draft or chained is not None
        ready, self.ready = self.ready, None
        levels = 0  # the levels a search drafted now, each costing a step (a tree drafted ahead was paid for during the
        if chained is not None:  # last round; a tree with no scores is a copy: prompt lookup, free)
            tree, decision, draft_s = chained.tree, chained.decision, 0.0  # sent during the last round
        else:
            if drafting and ready is not None:
                tree = ready.head(self.budget())  # drafted while the last round was verified (with room to spare)
            elif drafting:
                tree = drafter.propose(self.budget(), self.plan.depth)
                levels = max(depths(tree.parents), default=0) if tree.scores is not None else 0
            else:
                tree = DraftTree()  # a plain step: drafting has not been paying
            draft_s = clock() - t0
            stats.draft_s += draft_s
            decision = policy.size(tree, self.spec)
            tree = tree.head(decision.nodes)
            self.check_heartbeat()
        received = verifier.counters.bytes_received
        if self.pipeline and drafting:
            try:
                result = ahead.pipelined(self, tree, chained)
            except Stale:  # the round before did not commit what this one assumed (the client judged otherwise:
                return  # a tree the server cut); nothing verified, nothing changed: the next round drafts afresh
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
        policy.observe(Round(decision, tree, result.accepted, len(result.new_tokens), result.compute_s, draft_s,
                             levels, clock() - t0, drafting, result.load))  # fmt: skip

    def budget(self, ahead: int = 0) -> int:
        """The most tree nodes a round may send now (``ahead``: after this many more tokens are committed)."""
        room = self.verifier.max_context - len(self.prompt_ids) - len(self.out) - ahead
        return max(0, min(self.max_nodes, self.verifier.max_tree_nodes, room - 1))

    def check_heartbeat(self) -> None:
        """LinkDown if the heartbeat has found the server gone: no call is worth starting."""
        if self.heartbeat and self.heartbeat.dead.is_set():
            raise LinkDown(f"server {self.verifier.address}: {self.heartbeat.reason}")

    def deadline(self, nodes: int) -> float | None:
        """How long a Verify may take before the link is presumed dead: the RTT bound (SRTT + 4·RTTVAR), the
        server's expected compute with headroom (the larger of the recent rounds' and what the policy's cost curve
        says a tree this size takes; before it has measured one, a step a node), the transfers at the measured
        rates, a margin. None: no link, or nothing to
        fall back on (``fail``: a deadline could only turn a slow reply into a failed generation)."""
        link = self.verifier.link
        if link is None or self.resilience.on_reconnect == "fail":
            return None
        # no tree measured yet (a first round, or the first after streams): up to a step a node, as on a CPU, whose
        # verification grows with its rows (a streamed token's compute bounding a 36-node tree missed every time)
        compute = max(self.verify_s, self.policy.estimate(nodes) or self.verify_s * (nodes + 1))
        return round_s(link, compute, verify_request_bytes(nodes), int(2 * self.reply_bytes))

    def open(self, start: float) -> Verdict:
        """Open the session after the prompt and return its round: the server's first token, now ``self.out``, and
        the prefill's compute. Over a link the drafter prepares (``Drafter.prepare``) while the server prefills; in
        process it begins after the first token is shown, which does not wait for the drafter's prefill."""
        held = self.drafter.keep_for(self.prompt_ids) if self.spec else 0
        opened = self.beside_prepare(lambda: self.verifier.reopen(self.prompt_ids, self.sampling, spec=self.spec,
                                                                  held=held))  # fmt: skip
        self.unfeatured = None  # the prefill brings the features of every cached token
        if opened.load is not None:  # the server's costs size the first trees, before any is measured
            self.policy.observe(Loaded(opened.load))
        self.commit(opened.new_tokens, [True] * len(opened.new_tokens))
        self.started(start)
        self.drafter.begin(self.prompt_ids + opened.new_tokens, opened.features)
        return opened

    def beside_prepare(self, first: Callable[[], T]) -> T:
        """``first()``, the call that opens the session, while the drafter prepares (``Drafter.prepare``) over a link:
        the server's prefill and the drafter's run side by side, on two machines. In process, only ``first()``."""
        if self.verifier.link is None or self.flights is None:
            return first()
        call = self.flights.submit(first)
        self.drafter.prepare(self.prompt_ids)
        try:  # (the call is bounded by the verifier itself; this wait outlasts that bound)
            return call.result(timeout=UNBOUNDED_FLIGHT_S + FLIGHT_GRACE_S)
        except FutureTimeout:
            raise LinkDown(f"server {self.verifier.address}: the session's opening unanswered past its bound") from None

    def commit(self, out: list[int], verified: list[bool]) -> None:
        """The output is now ``out``, cut after its first stop token and at the token budget; tell ``on_update``."""
        end = next((i + 1 for i, t in enumerate(out) if t in self.stop), len(out))
        end = min(end, self.limit)
        self.out, self.verified = out[:end], verified[:end]
        if self.on_update:
            self.on_update(self.out, self.verified)

    def finished(self) -> str:
        """Why the output is complete ("" while it is not)."""
        return self.finished_with(self.out, self.verified)

    def finished_with(self, out: list[int], verified: list[bool]) -> str:
        """Why ``out`` would be a complete output: a stop token or string, the token budget, the context."""
        if out and out[-1] in self.stop:
            return "stop"
        if self.stop_when is not None and self.stop_when(out, verified):
            return "stop"
        if len(out) >= self.limit:
            return "length"
        if len(self.prompt_ids) + len(out) >= self.verifier.max_context:
            return "context"
        return ""


def verified_prefix(verified: list[bool]) -> int:
    """How many leading tokens the server has verified: what a stream may show under ``verify``."""
    return next((i for i, v in enumerate(verified) if not v), len(verified))


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
