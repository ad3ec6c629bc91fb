"""Where drafts get verified: the ``Verifier`` interface, and the target in this process (``LocalVerifier``).

The remote server over gRPC is the other ``Verifier`` (``client.net.remote``); the decode loop cannot tell them apart,
so ``--local`` is the single-device baseline of the very same loop.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from client.net.connection import Connection, LinkCounters
from client.net.link import LinkMonitor
from shared import payload
from shared.acceptance import SamplingParams
from shared.engine.prefixes import PrefixCache
from shared.engine.target import Verdict
from shared.errors import SplitspecError
from shared.features import Features
from shared.payload import PayloadSpec
from shared.tree import DraftTree
from shared.wire import splitspec_pb2 as pb

NO_PAYLOAD = PayloadSpec()  # no features: what a call returns unless its spec asks
LOCAL_PREFIX_MB = 256  # of the last sequences' KV ``--local`` keeps for a conversation's next turn


def first_spec(verifier: Verifier, specs: list[PayloadSpec]) -> PayloadSpec:
    """The first of ``specs`` (a drafter's ``payload_specs()``) that ``verifier`` can send; none if it can send none."""
    return next(iter(verifier.usable(specs)), NO_PAYLOAD)


@dataclass(frozen=True)
class Pending:
    """A chained round on its way (``Verifier.verify_after``). ``verdict()`` waits for it and takes it — the session
    moves on by it —, raising ``client.net.failures.Stale`` where the round before committed other tokens than assumed;
    ``drop()`` abandons it untaken (its reply, if any, changes nothing the client holds; the session's next call
    rolls back whatever it may have committed); ``done()``: whether its reply is in (or it failed)."""

    verdict: Callable[[], Verdict]
    drop: Callable[[], None]
    done: Callable[[], bool]


class Verifier(ABC):
    """Where the decode loop sends drafts. Each call's ``spec`` says which features of newly cached tokens come back
    with it (``shared.payload``; none by default); the loop may choose another for every call."""

    address: str = "in-process"
    connection: Connection | None = None  # the server's (``client.net.connection``): what a heartbeat watches
    eos_token_ids: list[int]
    max_tree_nodes: int
    max_context: int
    counters: LinkCounters
    link: LinkMonitor | None = None  # the measured link; None where there is none
    chains = False  # takes a chained round (``verify_after``): a second tree sent before the last one's verdict

    @abstractmethod
    def open(self, prompt_ids: list[int], sampling: SamplingParams, *, spec: PayloadSpec = NO_PAYLOAD,
             held: int = 0) -> Verdict:  # fmt: skip
        """Prefill a new session: the round that yields the first token (and the prompt's features; ``held``: the
        drafter holds those of the first ``held`` tokens, which a server then does not send again)."""

    @abstractmethod
    def verify(self, tree: DraftTree, timeout_s: float | None = None, *, spec: PayloadSpec = NO_PAYLOAD) -> Verdict:
        """One round; ``timeout_s`` bounds it (LinkDown past it)."""

    def verify_after(self, length: int, assumed: list[int], tree: DraftTree, timeout_s: float | None = None, *,
                     spec: PayloadSpec = NO_PAYLOAD) -> Pending:  # fmt: skip
        """A chained round, sent now, while the round before it is in flight: ``tree`` after the ``assumed`` tokens
        that round is guessed to commit to the ``length`` the session held before it. Its verdict is taken (or the
        call dropped) only after the round before's. Only where ``chains``."""
        raise SplitspecError(f"{type(self).__name__} verifies one round at a time: no chained rounds")

    @abstractmethod
    def close(self, timeout_s: float | None = None, wait: bool = True) -> None:
        """Free the session, if one is open; ``wait`` False: without waiting for the server's answer (a generation's
        end, where it would cost a round trip for nothing; a lost request leaves the session to the server's TTL)."""

    def reopen(self, prompt_ids: list[int], sampling: SamplingParams, *, spec: PayloadSpec = NO_PAYLOAD,
               held: int = 0) -> Verdict:  # fmt: skip
        """``open`` after closing the session this verifier had, if the server still has it (after a cut it may not:
        then its TTL frees it)."""
        try:
            self.close(timeout_s=2.0)
        except SplitspecError:
            pass
        return self.open(prompt_ids, sampling, spec=spec, held=held)

    def decode(self, max_new_tokens: int, stop_ids: list[int], payload_every: int = 1,
               timeout_s: float | None = None, self_draft: int = 0, *, spec: PayloadSpec = NO_PAYLOAD
               ) -> Iterator[Verdict]:  # fmt: skip
        """A stream: the target decodes by itself, one round per token, until a stop token or
        ``max_new_tokens``; the features of the tokens cached come every ``payload_every`` rounds and with the last;
        closing the iterator early ends it; ``self_draft``: the server may verify its own prompt-lookup drafts of up to
        this many tokens (``DecodeRequest.self_draft``). Here: plain verifications one by one (in process there is no
        round trip to save, and features come with every token); a server streams them (``RemoteVerifier.decode``)."""
        for _ in range(max_new_tokens):
            result = self.verify(DraftTree(), timeout_s, spec=spec)
            yield result
            if result.new_tokens[-1] in stop_ids:
                return

    def open_decode(self, prompt_ids: list[int], sampling: SamplingParams, max_new_tokens: int, stop_ids: list[int],
                    payload_every: int = 1, timeout_s: float | None = None, self_draft: int = 0, *,
                    spec: PayloadSpec = NO_PAYLOAD, held: int = 0) -> Iterator[Verdict]:  # fmt: skip
        """``open`` then ``decode``, in one call where there is a server (a round trip less): the first round is the
        open's, the rest as ``decode``'s, ``max_new_tokens`` in all. The prompt's features may come with a later
        round than the first (a server sends them after the first token, so they do not hold it up)."""
        first = self.open(prompt_ids, sampling, spec=spec, held=held)
        yield first
        if max_new_tokens > 1 and first.new_tokens[-1] not in stop_ids:
            yield from self.decode(max_new_tokens - 1, stop_ids, payload_every, timeout_s, self_draft, spec=spec)

    def fetch(self, start: int, end: int, spec: PayloadSpec) -> Features:
        """The features of cached tokens [start, end), asked for again (a cut kept a stream's last payload away)."""
        raise SplitspecError(f"{self.address}: features come with every round here; none to fetch")

    def usable(self, specs: list[PayloadSpec]) -> list[PayloadSpec]:
        """Those of ``specs`` this verifier can send (in their order)."""
        return list(specs)

    def reachable(self, timeout_s: float = 1.0) -> bool:
        """Is the server there (again)?"""
        return True

    def payload_bytes_per_token(self, spec: PayloadSpec) -> float:
        """Raw bytes (before zstd) one token's payload takes in ``spec`` across the link (none without a link)."""
        return 0.0


class LocalVerifier(Verifier):
    """The target in-process: no network, the single-device reference (it counts no server calls).

    Its features are exact (precision is moot) and it runs no drafter's LSA: MoA drafters get form kv. A session
    computes the features its opening's ``spec`` asks for and returns them with every later round, whatever that
    round's ``spec`` says (in process the policy has no payload to choose among, so the loop never changes it)."""

    def __init__(self, target):
        self.target = target
        self.eos_token_ids = target.eos_token_ids
        self.max_tree_nodes = 1 << 30
        self.max_context = target.max_context
        self.counters = LinkCounters()
        self.session = None
        # the last sequences' KV: a conversation's next turn prefills only what is new (where exact: ``PrefixCache``)
        self.prefixes = PrefixCache(LOCAL_PREFIX_MB * 2**20 if target.rows_independent else 0)

    def usable(self, specs: list[PayloadSpec]) -> list[PayloadSpec]:
        return [s for s in specs if s.form != "lsa"]

    def open(self, prompt_ids: list[int], sampling: SamplingParams, *, spec: PayloadSpec = NO_PAYLOAD,
             held: int = 0) -> Verdict:  # fmt: skip
        self.close()  # (features cost nothing in process: all of them come, ``held`` or not)
        kinds = payload.feature_kinds(spec)
        self.session = self.target.session(sampling, kinds)
        reuse = None if kinds else self.prefixes.take("", prompt_ids)  # a drafter fed features needs all the prompt's
        if reuse:
            self.session.reuse(reuse.k, reuse.v)
            self.counters.reused_tokens += reuse.length
        verdict = self.session.prefill(prompt_ids)
        self.counters.server_compute_s += verdict.compute_s
        if self.target.costs is not None:  # what trees cost here (the path timing's), before the policy timed one
            fixed, per_token = self.target.costs
            verdict = replace(verdict, load=pb.Load(sessions=1, step_s=fixed, node_s=per_token, prefer="latency"))
        return verdict

    def verify(self, tree: DraftTree, timeout_s: float | None = None, *, spec: PayloadSpec = NO_PAYLOAD) -> Verdict:
        verdict = self.session.verify(tree)
        self.counters.server_compute_s += verdict.compute_s
        return verdict

    def close(self, timeout_s: float | None = None, wait: bool = True) -> None:
        if self.session is not None and self.session.tokens:
            self.prefixes.keep("", self.session)
        self.session = None
