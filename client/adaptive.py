"""The adaptive policy: what the decode loop asks before each round and tells after it.

Two small parts, each in its own module: ``client.sizing`` — how big a round should be (the tree's size, its
depth, the payload), by a cost model of the round measured as decoding goes; ``client.schedule`` — which kind of
round comes next (drafted, plain, or the server decoding by itself: ``--mode``), a state machine judged by what
drafting and plain decoding measured. ``AdaptivePolicy`` joins them for the loop: its questions (``stretch``,
``extend``, ``drafts``, ``size``, the ``*_spec`` choices) change nothing; it learns only when told
(``rounded``, ``streamed``, ``loaded``, ``rehearsed``). Any choice can be pinned (``--max-tree-nodes``,
``--tree-depth``, ``--payload``, ``--precision``).
"""

from __future__ import annotations

import copy
from dataclasses import replace

from client.schedule import LOOKUP, Schedule
from client.sizing import Decision, Sizing
from shared.payload import PayloadSpec
from shared.tree import DraftTree


class AdaptivePolicy:
    """Sizes each round (``sizing``) and schedules the kind of the next (``schedule``). ``link``: the verifier's
    ``LinkMonitor`` (None in process); ``mode``: auto, draft or stream; ``lookup``: tokens a stream's server may
    copy by prompt lookup; the rest (``pin_nodes``, ``pin_depth``, ``pin_spec``, ``max_nodes``, ``specs``, ...)
    are ``Sizing``'s."""

    def __init__(self, link, mode: str = "auto", lookup: int = LOOKUP, **sizing) -> None:
        self.sizing = Sizing(link, **sizing)
        self.schedule = Schedule(self.sizing, mode, pinned=self.sizing.pin_nodes is not None, lookup=lookup)

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
                                      lookup=new.lookup, rehearsals=copy.copy(old_schedule.rehearsals))  # fmt: skip
            policy.schedule.resumed()
        return policy

    # --- questions ---

    def stretch(self) -> int:
        """Tokens for the server to decode by itself now (0: a round instead)."""
        return self.schedule.stretch()

    def extend(self) -> int:
        """A stretch is over: more tokens to read from the same stream (0: end it)."""
        return self.schedule.extend()

    def drafts(self) -> bool:
        """Does this round draft (else a plain step)?"""
        return self.schedule.drafts()

    def rehearse(self) -> bool:
        """Should a stream under way draft a tree it will not send (``client.schedule``)?"""
        return self.schedule.rehearse()

    @property
    def depth(self) -> int:
        """How deep to draft the next tree."""
        return self.sizing.depth

    @property
    def lookup(self) -> int:
        return self.schedule.lookup

    @property
    def calibration(self) -> float:
        """Accepted ÷ predicted drafts: how far the drafter's own probabilities can be trusted."""
        return self.sizing.calibration

    def size(self, tree: DraftTree, spec: PayloadSpec = PayloadSpec()) -> Decision:
        return self.sizing.size(tree, spec)

    def round_spec(self) -> PayloadSpec | None:
        return self.sizing.round_spec()

    def stream_spec(self) -> PayloadSpec | None:
        return self.sizing.stream_spec()

    def prompt_spec(self, prompt_tokens: int) -> PayloadSpec | None:
        return self.sizing.prompt_spec(prompt_tokens)

    def verify_estimate(self, nodes: int) -> float:
        """A verification of ``nodes`` nodes by the measured cost curve (0: nothing measured yet)."""
        return self.sizing.verify_fit(nodes + 1, default=0.0)

    # --- being told ---

    def rounded(self, decision: Decision, sent: DraftTree, accepted: int, tokens: int, compute_s: float,
                draft_s: float, depth: int, seconds: float, drafted: bool) -> None:  # fmt: skip
        """A round is over: ``decision`` sized it, ``sent`` as the server verified it, ``accepted`` of its nodes and
        ``tokens`` gained in all; ``compute_s`` of the server's, ``draft_s`` drafting ``depth`` levels, ``seconds``
        for the whole round as the loop saw it; ``drafted``: False for a plain step."""
        self.sizing.observe(decision, sent, accepted, compute_s, draft_s, depth)
        if drafted:
            self.schedule.drafted(tokens, seconds, decision.nodes, decision.kind == "explore")
        else:
            self.schedule.plain(tokens, seconds)

    def pipelines(self, on: bool) -> None:
        """The loop drafts ahead while a Verify is in flight (``client.decode``): drafting costs less than it takes."""
        self.sizing.pipelined = on

    def ahead(self, path_taken: bool, held: bool, seconds: float) -> None:
        """A pipelined round's guess: its likeliest path accepted or not, its next tree ready or not, the seconds
        drafting ahead took."""
        self.sizing.ahead(path_taken, held, seconds)

    def streamed(self, tokens: int, compute_s: float, seconds: float) -> None:
        """A stretch of a stream: ``tokens`` in ``seconds``, ``compute_s`` of them the server's compute."""
        self.sizing.streamed(tokens, compute_s)
        self.schedule.plain(tokens, seconds, stretch=True)

    def loaded(self, load) -> None:
        """The server's latest ``Load``, from any reply that carried one (None: this one did not)."""
        self.sizing.loaded(load)

    def rehearsed(self, tree: DraftTree, path: list[int], draft_s: float) -> None:
        """A rehearsal's outcome: ``path``, the nodes of ``tree`` the streamed tokens went through."""
        self.schedule.rehearsed(tree, path, draft_s)
