"""Network-adaptive drafting: each round, send the part of the draft tree that maximises expected tokens/s.

A round costs ``draft + verify(n) + RTT + upload(n)/up_rate + download/down_rate`` and gains
``1 + E[accepted | n]`` tokens. Everything in it is measured as decoding goes:

* ``E[accepted | n]`` — the drafter ranks its EAGLE-2 tree by cumulative log-probability, and the
  expected number of accepted nodes is the sum of the kept nodes' path probabilities
  ``Σ exp(score)``; a calibration factor (observed accepted ÷ predicted, averaged) corrects a
  drafter that is over- or under-confident. The tree comes parents-first in rank order, so
  keeping its first n nodes is exactly the tree a budget of n would have given.
* ``verify(n)`` — the server reports its compute time per call; running averages per size, interpolated
  between sizes and extended by a least-squares line, predict it for any n (``CostCurve``).
* ``RTT``, rates — the link monitor (``client.link``).
* ``draft`` — measured per depth step; the drafted depth follows the deepest node the policy
  actually kept (plus one), so drafting stops paying for levels that never get sent.

The payload spec (mode and precision) is chosen by what it costs to download per round: the most
faithful option whose transfer takes at most ``PAYLOAD_SHARE`` of the round, else the smallest.
``lsa`` ships one memory vector per token instead of every layer's KV, so it wins whenever the
server holds the drafter's bundle; precision only drops below fp16 on very slow links. Any of
these can be pinned (``--max-tree-nodes``/``--tree-depth``/``--payload``/``--precision``).

The mode (``--mode``): ``draft`` is the above, falling back to plain verification rounds while drafting
loses; ``stream`` has the server decode by itself and stream its tokens (server-side continuation: no
round trip per token); ``auto`` (the default) streams instead of stepping plainly — it starts with a
stretch of streamed tokens, tries drafting after each stretch and keeps whichever was faster, the
stretches growing while drafting loses (and no trial at all where even a perfect draft could not beat the
stream: a long round trip) — except that while the server says its compute is scarce
(``Load.prefer == "capacity"``) it drafts whenever that costs the server less per token than its
decoding would, by the costs the server reports.
"""

from __future__ import annotations

import copy
import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from client.costs import GAIN, CostCurve, verify_request_bytes
from shared.payload import PayloadSpec
from shared.tree import DraftTree, depths

# Verification cost is learned from the sizes actually sent, so sizes must vary: the first rounds
# send these shares of the tree, and every EXPLORE_EVERY-th round one of them again.
EXPLORE = (0.5, 0.25)
EXPLORE_EVERY = 8
# The first trees' depth; each round's grows to one past the deepest node that paid. Shallow first: where a
# draft step costs a good share of a target step (a CPU target on its low-bit kernels), a deep first tree
# costs more than its tokens are worth, and it grows in a few rounds where depth pays (a slow link).
START_DEPTH = 3
PAYLOAD_SHARE = 0.05  # a payload may take this share of a round before a smaller one is chosen
# Drafting itself must pay: after TRIAL drafted rounds whose measured tokens/s fall short of plain rounds', the
# policy decodes plain for PAUSE rounds, then tries drafting again (the text may have become predictable: code);
# each trial that fails again doubles the pause (quadruples it when drafting ran under half the plain speed), up to
# MAX_PAUSE, and one that pays resets it.
TRIAL = 2
PAUSE = 24
MAX_PAUSE = 384
# Plain rounds run to measure them when a trial ends and none has been seen: a plain round's cost predicted from
# the verify curve and the RTT misses what the loop pays per token besides (payloads, the drafter catching up).
PROBE = 2
UNMEASURED_STEP_S = 0.005  # a server's step before one was measured: a fast one, so a first stream's payloads are small
STREAM_SHARE = 0.5  # a stream's payloads may take this share of the downlink's time per streamed token
# Mode auto rehearses drafting while it streams (``rehearse``): the latest REHEARSALS unsent trees, scored against the
# tokens that came, predict what drafting would gain; MIN_REHEARSALS of them before the prediction is trusted.
REHEARSALS = 16
MIN_REHEARSALS = 3
LOOKUP = 10  # tokens a stream's server may copy by prompt lookup and verify in one step (``DecodeRequest.lookup``)
PROMPT_SHARE = 0.05  # seconds a prompt's payload may take on a link whose round trip is not yet measured
MODES = ("auto", "draft", "stream")
STREAM_ALL = 1 << 30  # mode stream: the rest of the generation in one stream


@dataclass
class Decision:
    nodes: int
    expected_gain: float
    expected_round_s: float


@dataclass
class AdaptivePolicy:
    """Chooses per round how many drafted nodes to verify, how deep to draft, and the payload.

    ``specs``: the payload specs the drafter may use, most faithful first (e.g. lsa/fp16, lsa/int8,
    kv/fp16: the drafter's ``payload_specs()`` the verifier can send); ``raw_bytes_per_token(spec)`` sizes
    them. ``pin_nodes``/``pin_depth``/``pin_spec`` fix a choice instead of adapting it.
    """

    link: object  # client.link.LinkMonitor (or None for a local verifier)
    max_nodes: int = 64
    max_depth: int = 8
    min_depth: int = 2
    specs: list[PayloadSpec] = field(default_factory=list)
    raw_bytes_per_token: object = None  # callable(spec) -> raw bytes per token
    pin_nodes: int | None = None
    pin_depth: int | None = None
    pin_spec: PayloadSpec | None = None
    verify_fit: CostCurve = field(default_factory=CostCurve)
    draft_step_s: float | None = None
    calibration: float = 1.0
    depth: int = 0
    rounds: int = 0
    history: list[Decision] = field(default_factory=list)
    drafted_rate: float | None = None  # tokens/s of whole drafted rounds as the decode loop saw them (running average)
    plain_seen: float | None = None  # tokens/s of whole plain rounds, likewise
    drafted_rounds: int = 0  # drafted rounds since drafting last resumed
    paused: int = 0  # plain rounds still to go before drafting is tried again
    probing: bool = False  # the plain rounds under way only measure plain speed (the trial goes on after them)
    exploring: bool = False  # the last cut was an exploration (a fixed share of the tree): not judged as drafting
    pause: int = PAUSE  # the next pause's length
    mode: str = "auto"
    load: object = None  # the server's latest ``Load`` (its costs and what it prefers); None: not told
    drafted_nodes: float | None = None  # tree nodes sent per drafted round (running average)
    drafted_gain: float | None = None  # tokens gained per drafted round (running average)
    token_s: float | None = None  # server compute per streamed token (running average)
    lookup: int = LOOKUP  # a stream lets the server draft this many tokens itself by prompt lookup (0: plain steps)
    # trees drafted during streams and never sent (see ``rehearse``): (nodes, the path the streamed tokens took
    # through it, seconds drafting it took), the latest REHEARSALS
    rehearsals: deque = field(default_factory=lambda: deque(maxlen=REHEARSALS))

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        self.depth = self.pin_depth or min(self.max_depth, START_DEPTH)
        if self.mode == "auto" and self.pin_nodes is None:
            self.paused = PAUSE  # an idle server decodes with no round trip per token: stream first, then try drafting

    # what a policy has learnt about the machine, the link and the drafter, which a later run of the same pair may
    # start from (``for_run(previous=...)``): the costs, the rates, the calibration, and where its pauses stand
    LEARNT = ("verify_fit", "draft_step_s", "calibration", "depth", "rounds", "drafted_rate", "plain_seen",
              "drafted_rounds", "paused", "pause", "drafted_nodes", "drafted_gain", "token_s", "rehearsals")

    @classmethod
    def for_run(cls, verifier, specs: list[PayloadSpec], previous: AdaptivePolicy | None = None,
                **pins) -> AdaptivePolicy:  # fmt: skip
        """A policy for a run against ``verifier`` that may switch among ``specs`` (a drafter's ``payload_specs()``),
        those the verifier can send; ``pins``: pin_nodes, pin_depth, max_nodes, ... ``previous``: the policy of an
        earlier run with the same target and drafter, whose learning this one starts from instead of exploring
        again (a process answering many prompts: the edge, the benchmarks); a trial it was in is judged anew, and a
        pause it was in lasts at most ``PAUSE`` more tokens."""
        if verifier.link is None and pins.get("mode", "auto") == "auto":
            pins["mode"] = "draft"  # in process there is no round trip for the target decoding alone to save
        policy = cls(verifier.link, specs=verifier.usable(specs) if verifier.link is not None else [],
                     raw_bytes_per_token=verifier.payload_bytes_per_token, **pins)  # fmt: skip
        if previous is not None:
            for name in cls.LEARNT:
                value = getattr(previous, name)
                setattr(policy, name, copy.deepcopy(value) if name in ("verify_fit", "rehearsals") else value)
            if previous.probing:  # its plain rounds were measuring a trial that ended with its run
                policy.paused, policy.drafted_rate, policy.drafted_rounds = 0, None, 0
            # a new prompt may be another kind of text (code after chat): its first trial comes within PAUSE tokens,
            # however long the last run's losses had made the pause (a losing trial still lengthens the next one)
            policy.paused = min(policy.paused, PAUSE)
        return policy

    # --- estimates ---

    def _transfer_s(self, up_bytes: float, down_bytes: float) -> tuple[float, float]:
        """(round trip, transfer) seconds on the link as measured; zero without a link."""
        if self.link is None:
            return 0.0, 0.0
        rtt = self.link.srtt_s or 0.0
        return rtt, self.link.transfer_s(int(up_bytes), int(down_bytes))

    def round_s(self, nodes: int, down_bytes: float) -> float:
        verify = self.verify_fit(nodes + 1, default=0.0)
        draft = (self.draft_step_s or 0.0) * self.depth
        rtt, transfer = self._transfer_s(verify_request_bytes(nodes), down_bytes)
        return draft + verify + rtt + transfer

    # --- the choices ---

    def streaming(self) -> int:
        """How many tokens the server should decode by itself now (0: a drafted or plain round instead). In mode
        auto, the stretch of plain rounds a losing trial earned is streamed in one go (see the module docstring)."""
        if self.mode == "stream":
            return STREAM_ALL
        if self.mode == "draft" or self.pin_nodes is not None:
            return 0
        if self.probing and self.paused == 0:  # the stream that measured plain speed is over: judge the trial
            self.probing = False
            self._judge()
        if self.paused <= 0 and self._skip_trial():
            self.paused = MAX_PAUSE
        if self.paused <= 0 or self.spare_server():
            return 0
        n, self.paused = self.paused, 0
        if not self.probing:
            self.drafted_rate, self.drafted_rounds = None, 0  # drafting after this stretch is a new trial
        return n

    def stream_spec(self) -> PayloadSpec | None:
        """The payload spec for a stream: the most faithful whose bytes take at most ``STREAM_SHARE`` of the
        downlink at the rate tokens stream (payloads must not throttle the stream); None: no choice to make. On a link
        whose rate is not measured yet the smallest (a first stream's payload then measures it, ``observe_gap``)."""
        unmeasured = self.link is not None and self.link.down_rate is None
        if unmeasured and self.specs and self.pin_spec is None and self.raw_bytes_per_token:
            return min(self.specs, key=self.raw_bytes_per_token)  # an unmeasured link may be slow: the smallest first
        step = self.token_s or self.verify_fit(1, default=UNMEASURED_STEP_S)  # the server's pace: a stream's own
        return self.choose_spec(1.0, STREAM_SHARE * step)  # rate may be bound by its payloads

    def prompt_spec(self, prompt_tokens: int) -> PayloadSpec | None:
        """The payload spec for a prompt's features: the most faithful whose download takes at most a round trip
        (``PROMPT_SHARE`` s before the link is measured); None: no choice to make."""
        rtt = self.link.srtt_s if self.link is not None else None
        return self.choose_spec(float(prompt_tokens), max(PROMPT_SHARE, rtt or 0.0))

    def rehearse(self) -> bool:
        """Should the stream under way draft a tree it will not send, to see what drafting would gain? (Mode auto:
        the client's own time is spare while the server decodes, and a rehearsal costs the server nothing.)"""
        return self.mode == "auto" and self.pin_nodes is None

    def rehearsed(self, tree: DraftTree, path: list[int], draft_s: float) -> None:
        """A rehearsal's outcome: ``path``, the nodes of ``tree`` the streamed tokens went through."""
        self.rehearsals.append((len(tree), path, draft_s))

    def rehearsed_rate(self) -> float | None:
        """Tokens/s drafting would reach by the rehearsals: for each tree size n, 1 + the nodes their ranked first n
        would have had accepted, over a round's predicted time (its drafting, a round trip, the server's verification
        of n nodes, the transfers); the best n. None until there are MIN_REHEARSALS."""
        if len(self.rehearsals) < MIN_REHEARSALS:
            return None
        largest = max(1, max(nodes for nodes, _, _ in self.rehearsals))
        draft_s = statistics.median(seconds for _, _, seconds in self.rehearsals)  # (the first may catch up a prompt)
        rtt, best = (self.link.srtt_s or 0.0) if self.link is not None else 0.0, 0.0
        for n in range(1, largest + 1):  # a path's nodes come in rank order: those below n are what head(n) keeps
            gain = 1 + sum(sum(i < n for i in path) for _, path, _ in self.rehearsals) / len(self.rehearsals)
            seconds = draft_s + rtt + self.verify_s(n) + self._transfer_s(verify_request_bytes(n), 0)[1]
            best = max(best, gain / seconds)
        return best

    def verify_s(self, nodes: int) -> float:
        """A verification of ``nodes`` nodes: as measured (the cost curve), else by the costs the server reports
        (``Load``), else a streamed token's compute."""
        if self.verify_fit.n:
            return self.verify_fit(nodes + 1, default=0.0)
        load = self.load
        if load is not None and (load.step_s or load.node_s):
            return load.step_s + (nodes + 1) * load.node_s
        return self.token_s or UNMEASURED_STEP_S

    def hopeless(self) -> bool:
        """Could drafting not beat streaming? By the rehearsals once there are enough; before, even at its best: a
        round gains at most the tree's depth and its bonus token (at most twice what drafted rounds gained so far,
        once some ran) and takes at least a round trip, the measured drafting and a plain step's verification. Then
        a trial is not worth its price (a long round trip, a drafter that rarely hits)."""
        rtt = self.link.srtt_s if self.link is not None else None
        if not rtt or not self.plain_seen:
            return False
        if (rate := self.rehearsed_rate()) is not None:
            return rate < self.plain_seen
        gain = 1 + self.depth if self.drafted_gain is None else min(1 + self.depth, 2 * self.drafted_gain)
        seconds = rtt + (self.draft_step_s or 0.0) * self.depth + self.verify_fit(1, default=0.0)
        return gain / seconds < self.plain_seen

    def extend(self) -> int:
        """A stretch is over: more tokens to read from the same stream (0: end it and draft). A hopeless trial (see
        ``hopeless``) is not started: the stream goes on, saving the round trip a new one would cost."""
        if self.mode == "stream":
            return STREAM_ALL
        if self.mode != "auto" or self.pin_nodes is not None:
            return 0
        return MAX_PAUSE if self._skip_trial() else 0

    def _skip_trial(self) -> bool:
        """Stream on, for the longest stretch, instead of trying drafting: it is hopeless and no busy server asks
        for it (each new stream would cost a round trip)."""
        if self.spare_server() or not self.hopeless():
            return False
        self.pause = MAX_PAUSE
        return True

    def spare_server(self) -> bool:
        """Does the server ask for its compute to be spared, and does drafting cost it less per token than decoding
        (by the costs it reports and this drafter's measured trees)? Untried drafting is given its chance."""
        load = self.load
        if load is None or load.prefer != "capacity" or not load.node_s:
            return False
        if self.drafted_gain is None:
            return True
        decoding = load.step_s + load.node_s
        drafting = (load.step_s + (self.drafted_nodes + 1) * load.node_s) / self.drafted_gain
        return drafting < decoding

    def drafting(self) -> bool:
        """Whether to draft this round at all: not while drafted rounds have been slower than plain steps (on a
        machine where a tree costs much more than a token, or with a drafter that rarely hits), with a new trial
        every ``PAUSE`` rounds. A pinned tree size always drafts; mode auto never steps plainly (it streams)."""
        if self.pin_nodes is not None or self.mode == "auto":
            return True
        if self.paused > 0:
            self.paused -= 1
            if self.paused == 0 and self.probing:  # plain rounds measured: the trial is judged now
                self.probing = False
                self._judge()  # (this round is still the probe's last)
            elif self.paused == 0:  # a new trial
                self.drafted_rate, self.drafted_rounds = None, 0
            return False
        return True

    def cut(self, tree: DraftTree, payload_per_token: float = 0.0) -> DraftTree:
        """The first n nodes of ``tree`` maximising expected tokens per second."""
        self.exploring = False
        if self.pin_nodes is not None or tree.scores is None or not tree.tokens:
            n = len(tree) if self.pin_nodes is None else min(self.pin_nodes, len(tree))
            self.history.append(Decision(n, float("nan"), float("nan")))
            return tree.head(n)
        self.rounds += 1
        explore = self.rounds - 1 if self.rounds <= len(EXPLORE) else None
        if explore is None and self.rounds % EXPLORE_EVERY == 0:
            explore = (self.rounds // EXPLORE_EVERY) % len(EXPLORE)
        if explore is not None:
            self.exploring = True
            n = max(1, math.ceil(EXPLORE[explore] * len(tree)))
            self.history.append(Decision(n, 1.0 + self.calibration * sum(map(math.exp, tree.scores[:n])), float("nan")))
            return tree.head(n)
        best, best_rate, best_gain, cumulative = 0, 0.0, 1.0, 0.0
        for n in range(0, len(tree) + 1):
            if n:
                cumulative += math.exp(tree.scores[n - 1])
            gain = 1.0 + self.calibration * cumulative
            seconds = self.round_s(n, gain * payload_per_token)
            rate = gain / seconds if seconds > 0 else gain
            if rate > best_rate * (1 + 1e-9):
                best, best_rate, best_gain = n, rate, gain
        self.history.append(Decision(best, best_gain, best_gain / best_rate if best_rate else 0.0))
        if self.pin_depth is None:
            depth = max(depths(tree.parents[:best]), default=0)
            self.depth = max(self.min_depth, min(self.max_depth, depth + 1))
        return tree.head(best)

    def loaded(self, load) -> None:
        """The server's latest ``Load``, from any reply that carried one (None: this one did not)."""
        self.load = load or self.load

    def streamed(self, tokens: int, compute_s: float, seconds: float) -> None:
        """A stretch of a stream: ``tokens`` tokens in ``seconds``, ``compute_s`` of them the server's compute (its
        pace per token, which sizes the next stretch)."""
        if tokens <= 0:
            return
        self.record(False, tokens, seconds)
        if compute_s > 0:
            step = compute_s / tokens
            self.token_s = step if self.token_s is None else (1 - GAIN) * self.token_s + GAIN * step

    def record(self, drafted: bool, tokens: int, seconds: float) -> None:
        """A whole round as the decode loop saw it — drafting, verification, absorbing, emitting, the link —
        so that drafted and plain rounds compare in the same currency; pauses drafting when it loses."""
        if seconds <= 0 or tokens <= 0:
            return
        rate = tokens / seconds
        if not drafted:
            self.plain_seen = rate if self.plain_seen is None else (1 - GAIN) * self.plain_seen + GAIN * rate
            return
        nodes = self.history[-1].nodes if self.history else 0
        self.drafted_nodes = nodes if self.drafted_nodes is None else (1 - GAIN) * self.drafted_nodes + GAIN * nodes
        self.drafted_gain = tokens if self.drafted_gain is None else (1 - GAIN) * self.drafted_gain + GAIN * tokens
        if self.exploring:
            return  # a share of the tree fixed to learn the cost curve, not what the policy would send
        self.drafted_rate = rate if self.drafted_rate is None else (1 - GAIN) * self.drafted_rate + GAIN * rate
        self.drafted_rounds += 1
        if self.drafted_rounds >= TRIAL and self.plain_seen is None:
            self.paused, self.probing = PROBE, True  # measure plain rounds before judging
        elif self.drafted_rounds >= TRIAL:
            self._judge()

    def _judge(self) -> None:
        """Pause drafting (for longer each time) while its rounds fall short of plain ones: twice as long after a
        close loss, four times after drafting ran at under half the plain speed (a trial has its price)."""
        if self.drafted_rate < self.plain_seen:
            growth = 2 if 2 * self.drafted_rate >= self.plain_seen else 4
            self.paused, self.pause = self.pause, min(MAX_PAUSE, growth * self.pause)
        else:
            self.pause = PAUSE  # drafting pays: a later loss pauses briefly again

    def choose_spec(self, expected_tokens: float | None = None, budget_s: float | None = None) -> PayloadSpec | None:
        """The payload spec for the next round, sized for ``expected_tokens`` per round (default: what the
        last round expected), whose download may take ``budget_s`` (default: ``PAYLOAD_SHARE`` of the last round);
        None: no choice to make."""
        if self.pin_spec is not None or not self.specs:
            return self.pin_spec
        if expected_tokens is None:
            expected_tokens = 1.0 + (self.history[-1].expected_gain if self.history else 1.0)
        if not math.isfinite(expected_tokens):
            expected_tokens = 2.0
        last = self.history[-1].expected_round_s if self.history else float("nan")
        budget = PAYLOAD_SHARE * (last if math.isfinite(last) and last > 0 else 0.1) if budget_s is None else budget_s
        sized = [(spec, expected_tokens * self.raw_bytes_per_token(spec)) for spec in self.specs]
        for spec, size in sized:
            if self._transfer_s(0, size)[1] <= budget:
                return spec
        return min(sized, key=lambda pair: pair[1])[0]

    # --- learning from what happened ---

    def observe(self, sent: DraftTree, accepted: int, compute_s: float, draft_s: float, depth: int) -> None:
        if compute_s > 0:
            self.verify_fit.add(len(sent) + 1, compute_s)

        if depth > 0:
            step = draft_s / depth
            self.draft_step_s = step if self.draft_step_s is None else (1 - GAIN) * self.draft_step_s + GAIN * step
        if sent.scores:
            predicted = sum(math.exp(s) for s in sent.scores)
            if predicted > 0.05:
                ratio = min(3.0, max(0.2, accepted / predicted))
                self.calibration = (1 - GAIN) * self.calibration + GAIN * ratio

