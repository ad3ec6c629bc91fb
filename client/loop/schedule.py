"""Which kind of round comes next: drafted, plain, or the server decoding by itself (``--mode``).

``draft`` drafts every round, falling back to plain verification rounds while drafting loses; ``stream`` has
the server decode by itself and stream its tokens (no round trip per token);
``auto`` (the default) streams instead of stepping plainly — it starts with a stretch of streamed tokens,
tries drafting after each stretch and keeps whichever was faster, the stretches growing while drafting loses
(and no trial at all where even a perfect draft could not beat the stream: a long round trip) — except that
while the server says its compute is scarce (``Load.prefer == "capacity"``) it drafts whenever that costs the
server less per token than its decoding would, by the costs the server reports.

The schedule is a small state machine (``Phase``), changed only by what it is told (``drafted``, ``plain``,
``rehearsed``); its questions (``stretch``, ``extend``, ``drafts``) change nothing:

* ``TRIAL`` — drafting; after ``TRIAL`` rounds its measured tokens/s are judged against plain decoding's after
  every round: a loss starts a ``PAUSE``, a win keeps drafting;
* ``PAUSE`` — ``left`` plain tokens (plain rounds in mode draft, a stream in mode auto), then a new trial;
* ``MEASURE`` — ``left`` plain tokens to measure plain decoding, which a trial had not seen yet, then the trial is
  judged.

Each trial that fails again doubles the next pause (quadruples it when drafting ran under half the plain speed),
up to ``MAX_PAUSE``, and one that pays resets it. The costs it judges by are ``client.loop.sizing``'s.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from client.loop.costs import GAIN, verify_request_bytes
from client.loop.sizing import Sizing
from shared.tree import DraftTree

TRIAL = 2
PAUSE = 24
MAX_PAUSE = 384
# Plain tokens decoded to measure them when a trial ends and none has been seen: a plain round's cost predicted from
# the verify curve and the RTT misses what the loop pays per token besides (payloads, the drafter catching up).
MEASURE = 2
# Mode auto rehearses drafting while it streams (``rehearse``): the latest REHEARSALS unsent trees, scored against the
# tokens that came, predict what drafting would gain; MIN_REHEARSALS of them before the prediction is trusted.
REHEARSALS = 16
MIN_REHEARSALS = 3
# A trial is run only where the rehearsals predict drafting at least this much faster than the stream: a trial has a
# price (the stream cut, the first rounds' catching up) and a prediction from a few trees is noisy: where drafting
# and the stream are close, the noise alone would start losing trials.
TRIAL_MARGIN = 1.1
# tokens a stream's server may copy by prompt lookup and verify in one step (``DecodeRequest.self_draft``): a CPU
# forward's cost grows with its rows past a few, so a long copy that misses late costs more than it gains. The 1.5B
# over 4g, HumanEval (4 prompts, server on one core): server ms a token 0.545x the API's at 10, 0.522x at 8,
# 0.504-0.515x at 6, 0.542x at 4; MT-Bench 1.01-1.05x at each (whole bench-pair-network runs: 0.536x -> 0.530x)
SELF_DRAFT = 6
MODES = ("auto", "draft", "stream")
STREAM_ALL = 1 << 30  # mode stream: the rest of the generation in one stream


class Phase(Enum):
    TRIAL = "trial"
    PAUSE = "pause"
    MEASURE = "measure"


@dataclass
class Schedule:
    """When to draft, step plainly or stream. ``costs``: the cost model it judges hopelessness and the server's
    spare compute by; ``pinned``: a pinned tree size (always draft, never judged)."""

    costs: Sizing
    mode: str = "auto"
    pinned: bool = False
    phase: Phase | None = None  # None: the mode's first (auto: a PAUSE, streaming first; else a TRIAL)
    left: int = 0  # plain tokens still to go in a PAUSE or a MEASURE
    pause: int = PAUSE  # the next pause's length
    drafted_rate: float | None = None  # tokens/s of whole drafted rounds as the decode loop saw them: over the trial's
    # first TRIAL rounds, their total tokens over their total time; a running average after
    trial_tokens: int = 0  # tokens and seconds of the trial's first rounds
    trial_s: float = 0.0
    plain_seen: float | None = None  # tokens/s of whole plain rounds and streamed stretches, likewise
    drafted_rounds: int = 0  # drafted rounds since the trial began
    drafted_nodes: float | None = None  # tree nodes sent per drafted round (running average)
    drafted_gain: float | None = None  # tokens gained per drafted round (running average)
    self_draft: int = SELF_DRAFT  # a stream lets the server draft this many tokens itself (0: plain steps)
    # trees drafted during streams and never sent (see ``rehearse``): (nodes, the path the streamed tokens took
    # through it, seconds drafting it took), the latest REHEARSALS
    rehearsals: deque = field(default_factory=lambda: deque(maxlen=REHEARSALS))

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.phase is None and self.mode == "auto" and not self.pinned:
            self.phase, self.left = Phase.PAUSE, PAUSE  # an idle server decodes with no round trip per token: stream
        elif self.phase is None:  # first, then try drafting
            self.phase = Phase.TRIAL

    # --- the questions ---

    def stretch(self) -> int:
        """How many tokens the server should decode by itself now (0: a drafted or plain round instead)."""
        if self.mode == "stream":
            return STREAM_ALL
        if self.mode == "draft" or self.pinned or self.phase is Phase.TRIAL or self.spare_server():
            return 0
        return self.left

    def extend(self) -> int:
        """A stretch is over (and told): more tokens to read from the same stream (0: end it and draft)."""
        return self.stretch() if self.mode != "draft" and not self.pinned else 0

    def drafts(self) -> bool:
        """Whether this round drafts at all: not during a pause or a measurement in mode draft. A pinned tree size
        always drafts; mode auto never steps plainly (it streams instead)."""
        return self.pinned or self.mode != "draft" or self.phase is Phase.TRIAL

    def rehearse(self) -> bool:
        """Should the stream under way draft a tree it will not send, to see what drafting would gain? (Mode auto:
        the client's own time is spare while the server decodes, and a rehearsal costs the server nothing.)"""
        return self.mode == "auto" and not self.pinned

    def rehearsed_rate(self) -> float | None:
        """Tokens/s drafting would reach by the rehearsals: for each tree size n, 1 + the nodes their ranked first n
        would have had accepted, over a round's predicted time (its drafting — pipelined, what the rehearsals' paths
        say a guess would have hidden of it —, a round trip, the server's verification of n nodes, the transfers);
        the best n. None until there are MIN_REHEARSALS."""
        if len(self.rehearsals) < MIN_REHEARSALS:
            return None
        costs = self.costs
        largest = max(1, max(nodes for nodes, _, _, _ in self.rehearsals))
        draft_s = statistics.median(r[2] for r in self.rehearsals)  # (the first may catch up a prompt)
        rtt, best = costs.transfer_s(0, 0)[0], 0.0
        for n in range(1, largest + 1):  # a path's nodes come in rank order: those below n are what head(n) keeps
            gain = 1 + sum(sum(i < n for i in path) for _, path, _, _ in self.rehearsals) / len(self.rehearsals)
            taken = statistics.fmean(set(i for i in chain if i < n) <= set(path) for _, path, _, chain in
                                     self.rehearsals)  # fmt: skip
            wire = rtt + costs.verify_s(n) + costs.transfer_s(verify_request_bytes(n), 0)[1]
            seconds = wire + costs.exposed_s(draft_s, taken, wire)
            best = max(best, gain / seconds)
        return best

    def hopeless(self) -> bool:
        """Could drafting not beat streaming? By the rehearsals once there are enough (by ``TRIAL_MARGIN``); before,
        even at its best: a
        round gains at most the tree's depth and its bonus token (at most twice what drafted rounds gained so far,
        once some ran) and takes at least a round trip, the measured drafting and a plain step's verification. Then
        a trial is not worth its price (a long round trip, a drafter that rarely hits)."""
        costs = self.costs
        rtt = costs.link.srtt_s if costs.link is not None else None
        if not rtt or not self.plain_seen:
            return False
        if (rate := self.rehearsed_rate()) is not None:
            return rate < TRIAL_MARGIN * self.plain_seen
        gain = 1 + costs.depth if self.drafted_gain is None else min(1 + costs.depth, 2 * self.drafted_gain)
        wire = rtt + costs.verify_fit(1, default=0.0)
        seconds = wire + costs.exposed_s((costs.draft_step_s or 0.0) * costs.depth, 1.0, wire)  # at best: all hidden
        return gain / seconds < self.plain_seen

    def spare_server(self) -> bool:
        """Does the server ask for its compute to be spared, and does drafting cost it less per token than decoding
        (by the costs it reports and this drafter's measured trees)? Untried drafting is given its chance."""
        load = self.costs.load
        if load is None or load.prefer != "capacity" or not load.node_s:
            return False
        if self.drafted_gain is None:
            return True
        decoding = load.step_s + load.node_s
        drafting = (load.step_s + (self.drafted_nodes + 1) * load.node_s) / self.drafted_gain
        return drafting < decoding

    # --- being told ---

    def drafted(self, tokens: int, seconds: float, nodes: int, explored: bool) -> None:
        """A drafted round as the decode loop saw it — drafting, verification, absorbing, emitting, the link —
        ``nodes`` sent, ``tokens`` gained; ``explored``: its size was an exploration's, not judged as drafting."""
        if seconds <= 0 or tokens <= 0:
            return
        self.drafted_nodes = nodes if self.drafted_nodes is None else (1 - GAIN) * self.drafted_nodes + GAIN * nodes
        self.drafted_gain = tokens if self.drafted_gain is None else (1 - GAIN) * self.drafted_gain + GAIN * tokens
        if not explored:
            self.drafted_rounds += 1
            if self.drafted_rounds <= TRIAL:  # a running average would weigh the first round (its catching up) most
                self.trial_tokens, self.trial_s = self.trial_tokens + tokens, self.trial_s + seconds
                self.drafted_rate = self.trial_tokens / self.trial_s
            else:
                self.drafted_rate = (1 - GAIN) * self.drafted_rate + GAIN * tokens / seconds
            if self.drafted_rounds >= TRIAL and self.plain_seen is None:
                self.phase, self.left = Phase.MEASURE, MEASURE  # measure plain decoding before judging
            elif self.drafted_rounds >= TRIAL:
                self._judge()
        self._skip_hopeless()

    def plain(self, tokens: int, seconds: float, stretch: bool = False) -> None:
        """Plain decoding — a plain round, or (``stretch``) a stretch the server streamed: ``tokens`` in ``seconds``.
        A pause or a measurement that it completes ends (a measurement's trial is judged, a pause's new trial
        begins); a stretch completes the whole of it (it was granted all of it, and streamed it, or the generation
        ended)."""
        if seconds > 0 and tokens > 0:
            rate = tokens / seconds
            self.plain_seen = rate if self.plain_seen is None else (1 - GAIN) * self.plain_seen + GAIN * rate
        elif not stretch:
            return
        if self.phase is not Phase.TRIAL:
            self.left = 0 if stretch else max(0, self.left - tokens)
            if self.left:
                return
            if self.phase is Phase.MEASURE:
                self.phase = Phase.TRIAL
                self._judge()
            else:
                self._new_trial()
        self._skip_hopeless()

    def rehearsed(self, tree: DraftTree, path: list[int], draft_s: float) -> None:
        """A rehearsal's outcome: ``path``, the nodes of ``tree`` the streamed tokens went through."""
        self.rehearsals.append((len(tree), path, draft_s, tree.chain_of_firsts()))

    def _skip_hopeless(self) -> None:
        """Mode auto, in a trial that could not pay (``hopeless``) and no busy server asks for drafting: stream on
        instead, for the longest stretch (each new stream costs a round trip). Looked at after everything told."""
        if self.mode == "auto" and not self.pinned and self.phase is Phase.TRIAL and not self.spare_server() and (
                self.hopeless()):  # fmt: skip
            self.phase, self.left, self.pause = Phase.PAUSE, MAX_PAUSE, MAX_PAUSE

    def _judge(self) -> None:
        """Pause drafting (for longer each time) while its rounds fall short of plain ones: twice as long after a
        close loss, four times after drafting ran at under half the plain speed (a trial has its price)."""
        if self.drafted_rate is None or self.drafted_rate >= self.plain_seen:
            self.pause = PAUSE  # drafting pays: a later loss pauses briefly again
            return
        growth = 2 if 2 * self.drafted_rate >= self.plain_seen else 4
        self.phase, self.left, self.pause = Phase.PAUSE, self.pause, min(MAX_PAUSE, growth * self.pause)

    def resumed(self) -> None:
        """A new run starts from this schedule (``AdaptivePolicy.for_run``): a new prompt may be another kind of text
        (code after chat), so the pauses grow again from ``PAUSE`` and mode draft starts with a trial (two rounds
        risked against a whole answer's gain); mode auto goes on streaming for at most ``PAUSE`` more tokens, its
        rehearsals judging drafting meanwhile at no cost."""
        if self.mode == "draft" or self.phase is Phase.MEASURE:  # a measurement's trial ended with its run
            self._new_trial()
        self.left, self.pause = min(self.left, PAUSE), PAUSE
        self._skip_hopeless()

    def _new_trial(self) -> None:
        self.phase, self.left, self.drafted_rate, self.drafted_rounds = Phase.TRIAL, 0, None, 0
        self.trial_tokens, self.trial_s = 0, 0.0
