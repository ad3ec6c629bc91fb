"""The policy: what the decode loop asks before each round (``plan``) and tells after it (``observe``).

A policy answers questions without changing (``plan``: what kind of call comes next, how deep to draft, which
payload; ``size``: how much of a drafted tree to send) and learns only from the outcomes it is told (``Round``,
``Streamed``, ``Ahead``, ``Rehearsal``, ``Loaded``, ``Pipelining``). Two policies share that interface:
``StaticPolicy`` drafts every round to the drafter's own depth and sends the whole tree; ``AdaptivePolicy`` joins
two small parts, each in its own module — ``client.loop.sizing`` (how big a round should be: the tree's size, its depth,
the payload, by a cost model measured as decoding goes) and ``client.loop.schedule`` (which kind of round comes next:
drafted, plain, or the server decoding by itself, ``--mode``). Any choice can be pinned (``--max-tree-nodes``,
``--tree-depth``, ``--payload``, ``--precision``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Protocol

from client.loop.schedule import SELF_DRAFT, Schedule
from client.loop.sizing import Decision, Sizing
from shared.payload import PayloadSpec
from shared.tree import DraftTree


@dataclass(frozen=True)
class State:
    """What the loop knows when it asks: the prompt's and the output's length, and whether a stream is under way
    (its stretch is over and the question is whether to read on)."""

    prompt_tokens: int
    generated: int = 0
    streaming: bool = False


@dataclass(frozen=True)
class Plan:
    """The next call: ``stream`` tokens for the server to decode by itself (0: a round), else a round that drafts
    (``draft``; False: a plain step) ``depth`` levels deep (None: the drafter's own depth); ``spec``: the payload
    it asks for (None: as before); ``self_draft``: tokens a stream's server may copy by prompt lookup; ``rehearse``: a
    stream drafts trees it will not send, to learn what drafting would gain (``client.loop.schedule``)."""

    stream: int = 0
    draft: bool = True
    depth: int | None = None
    spec: PayloadSpec | None = None
    self_draft: int = 0
    rehearse: bool = False


@dataclass(frozen=True)
class Round:
    """A verification round: ``decision`` sized it, ``sent`` as the server verified it, ``accepted``: its nodes the
    target took (indices), ``tokens`` gained in all; ``compute_s`` the server's, ``draft_s`` drafting ``levels``
    levels, ``seconds`` the whole round as the loop saw it; ``drafted``: False for a plain step; ``load``: the
    server's ``Load`` (None: the reply carried none)."""

    decision: Decision
    sent: DraftTree
    accepted: list[int]
    tokens: int
    compute_s: float
    draft_s: float
    levels: int
    seconds: float
    drafted: bool = True
    load: object = None


@dataclass(frozen=True)
class Streamed:
    """A stretch of a stream: ``tokens`` in ``seconds``, ``compute_s`` of them the server's compute."""

    tokens: int
    compute_s: float
    seconds: float


@dataclass(frozen=True)
class Ahead:
    """A pipelined round's guess: its likeliest path accepted (``path_taken``) or not, its next tree ready
    (``held``) or not, the ``seconds`` drafting ahead took; ``sent``: the next round went out chained, before the
    verdict."""

    path_taken: bool
    held: bool
    seconds: float
    sent: bool = False


@dataclass(frozen=True)
class Rehearsal:
    """A tree drafted during a stream and never sent, and ``path``: its nodes the streamed tokens went through."""

    tree: DraftTree
    path: list[int]
    draft_s: float


@dataclass(frozen=True)
class Loaded:
    """The server's latest ``Load``, from any reply that carried one."""

    load: object


@dataclass(frozen=True)
class Pipelining:
    """Whether the loop drafts ahead while a Verify is in flight (``client.loop.decode``): drafting then costs a round
    less than it takes; ``chained``: and sends that tree before the verdict, hiding the round trip too."""

    on: bool
    chained: bool = False


Outcome = Round | Streamed | Ahead | Rehearsal | Loaded | Pipelining


class Policy(Protocol):
    """What the decode loop asks and tells; it knows no other member."""

    def plan(self, state: State) -> Plan: ...

    def size(self, tree: DraftTree, spec: PayloadSpec) -> Decision: ...

    def observe(self, outcome: Outcome) -> None: ...

    @property
    def calibration(self) -> float:
        """Accepted ÷ predicted drafts: how far the drafter's own probabilities can be trusted."""
        ...

    def estimate(self, nodes: int) -> float:
        """Seconds of the server's compute a verification of ``nodes`` nodes takes (0: nothing known)."""
        ...

    def survival(self, p: float | None) -> float:
        """The chance that a token made offline, which the drafter gave probability ``p`` (None: a copy), is the
        target's own."""
        ...


class StaticPolicy:
    """Every round drafts to the drafter's own depth and sends its whole tree; nothing is learnt."""

    calibration = 1.0

    def plan(self, state: State) -> Plan:
        return Plan()

    def size(self, tree: DraftTree, spec: PayloadSpec = PayloadSpec()) -> Decision:
        return Decision(len(tree), float("nan"), float("nan"), "pinned")

    def observe(self, outcome: Outcome) -> None:
        pass

    def estimate(self, nodes: int) -> float:
        return 0.0

    def survival(self, p: float | None) -> float:
        return 1.0 if p is None else p


class AdaptivePolicy:
    """Sizes each round (``sizing``) and schedules the kind of the next (``schedule``). ``link``: the verifier's
    ``LinkMonitor`` (None in process); ``mode``: auto, draft or stream; ``self_draft``: tokens a stream's server may
    copy by prompt lookup; the rest (``pin_nodes``, ``pin_depth``, ``pin_spec``, ``max_nodes``, ``specs``, ...)
    are ``Sizing``'s."""

    def __init__(self, link, mode: str = "auto", self_draft: int = SELF_DRAFT, **sizing) -> None:
        self.sizing = Sizing(link, **sizing)
        self.schedule = Schedule(self.sizing, mode, pinned=self.sizing.pin_nodes is not None,
                                 self_draft=self_draft)

    @classmethod
    def for_run(cls, verifier, specs: list[PayloadSpec], previous: AdaptivePolicy | None = None,
                **pins) -> AdaptivePolicy:  # fmt: skip
        """A policy for a run against ``verifier`` that may switch among ``specs`` (a drafter's ``payload_specs()``),
        those the verifier can send; ``pins``: pin_nodes, pin_depth, max_nodes, mode, ... ``previous``: the policy
        of an earlier run with the same target and drafter, whose learning this one starts from instead of exploring
        again (a process answering many prompts: the edge, the benchmarks; see ``Schedule.resumed``)."""
        if verifier.link is None and pins.get("mode", "auto") == "auto":
            pins["mode"] = "draft"  # in process there is no round trip for the target decoding alone to save
        policy = cls(verifier.link, specs=verifier.usable(specs) if verifier.link is not None else [],
                     raw_bytes_per_token=verifier.payload_bytes_per_token, **pins)  # fmt: skip
        if previous is not None:
            learnt, old = policy.sizing, previous.sizing  # what was learnt about the machine, the link, the drafter
            learnt.verify_fit, learnt.draft_step_s = copy.deepcopy(old.verify_fit), old.draft_step_s
            learnt.calibration, learnt.depth, learnt.rounds, learnt.token_s = (
                old.calibration, old.depth, old.rounds, old.token_s)  # fmt: skip
            # where its trials and pauses stood, under this run's mode and pins
            new, old_schedule = policy.schedule, previous.schedule
            policy.schedule = replace(old_schedule, costs=learnt, mode=new.mode, pinned=new.pinned,
                                      self_draft=new.self_draft,
                                      rehearsals=copy.copy(old_schedule.rehearsals))  # fmt: skip
            policy.schedule.resumed()
        return policy

    def plan(self, state: State) -> Plan:
        """The next call. A stream under way reads on for ``schedule.extend()`` more tokens; otherwise the server
        decodes a stretch by itself (``schedule.stretch()``) or a round comes, drafted (``schedule.drafts()``) to
        ``sizing.depth``. The payload: a stream's, the prompt's (nothing generated yet) or a round's."""
        schedule, sizing = self.schedule, self.sizing
        stream = schedule.extend() if state.streaming else schedule.stretch()
        if stream:
            spec = sizing.stream_spec()
        elif not state.generated:
            spec = sizing.prompt_spec(state.prompt_tokens)
        else:
            spec = sizing.round_spec()
        return Plan(stream, schedule.drafts(), sizing.depth, spec, schedule.self_draft, schedule.rehearse())

    def size(self, tree: DraftTree, spec: PayloadSpec = PayloadSpec()) -> Decision:
        """How many of ``tree``'s first nodes to send (``Sizing.size``)."""
        return self.sizing.size(tree, spec)

    @property
    def calibration(self) -> float:
        return self.sizing.calibration

    def estimate(self, nodes: int) -> float:
        return self.sizing.verify_fit(nodes + 1, default=0.0)

    def survival(self, p: float | None) -> float:
        return self.sizing.survival(p)

    def observe(self, outcome: Outcome) -> None:
        """Learn from what happened; the only way this policy changes."""
        sizing, schedule = self.sizing, self.schedule
        match outcome:
            case Round():
                sizing.loaded(outcome.load)
                sizing.observe(outcome.decision, outcome.sent, len(outcome.accepted), outcome.compute_s,
                               outcome.draft_s, outcome.levels)  # fmt: skip
                sizing.firsts(outcome.sent, outcome.accepted)
                if outcome.drafted:
                    schedule.drafted(outcome.tokens, outcome.seconds, outcome.decision.nodes,
                                     outcome.decision.kind == "explore")  # fmt: skip
                else:
                    schedule.plain(outcome.tokens, outcome.seconds)
            case Streamed():
                sizing.streamed(outcome.tokens, outcome.compute_s)
                schedule.plain(outcome.tokens, outcome.seconds, stretch=True)
            case Ahead():
                sizing.ahead(outcome.path_taken, outcome.held, outcome.seconds, outcome.sent)
            case Rehearsal():
                schedule.rehearsed(outcome.tree, outcome.path, outcome.draft_s)
                sizing.firsts(outcome.tree, outcome.path)
            case Loaded():
                sizing.loaded(outcome.load)
            case Pipelining():
                sizing.pipelined, sizing.chained = outcome.on, outcome.on and outcome.chained
            case _:
                raise TypeError(f"not an outcome a policy learns from: {outcome!r}")
