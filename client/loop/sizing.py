"""How big a round should be: the tree size, the drafting depth and the payload that maximise expected tokens/s.

A round costs ``draft + verify(n) + RTT + upload(n)/up_rate + download/down_rate`` and gains
``1 + E[accepted | n]`` tokens. Everything in it is measured as decoding goes:

* ``E[accepted | n]`` — the drafter ranks its EAGLE-2 tree by cumulative log-probability, and the
  expected number of accepted nodes is the sum of the kept nodes' path probabilities
  ``Σ exp(score)``; a calibration factor (observed accepted ÷ predicted, averaged) corrects a
  drafter that is over- or under-confident. The tree comes parents-first in rank order, so
  keeping its first n nodes is exactly the tree a budget of n would have given.
* ``verify(n)`` — the server reports its compute time per call; running averages per size, interpolated
  between sizes and extended by a least-squares line, predict it for any n (``CostCurve``).
* ``RTT``, rates — the link monitor (``client.net.link``).
* ``draft`` — measured per depth step; with pipelined rounds (``client.loop.decode``) only the part not hidden behind
  the wire: a round whose likeliest path is accepted (the drafter's own probability of it, calibrated) and whose
  bonus it guessed (``hit``, measured) finds its next tree drafted during the flight, so drafting costs only what
  drafting ahead (``ahead_s``, measured) takes past the wire; the others draft as ever. Chained (the tree drafted
  ahead sent before the verdict), such a round also hides its round trip: it costs the longer of its verification and
  the drafting ahead (``chain_s``). A cut that ends the tree's
  likeliest path deeper is worth more tokens but holds less often. This round's drafting is spent when its tree is
  cut, but the next
  tree's depth is a choice: the cut that would be best had each level cost its step (the deepest level it keeps,
  one more if it keeps every level drafted). A draft step that costs a good share of a target step (a whole model
  drafting) then stops at the depth where one more level costs more time than its tokens save.

The payload spec (mode and precision) is chosen by what it costs to download per round: the most
faithful option whose transfer takes at most ``PAYLOAD_SHARE`` of the round, else the smallest.
``lsa`` ships one memory vector per token instead of every layer's KV, so it wins whenever the
server holds the drafter's bundle; precision only drops below fp16 on very slow links.

``Sizing`` answers (``size``, ``round_spec``, ``stream_spec``, ``prompt_spec``) without changing itself and learns
only when told what a round cost (``observe``) or what a stretch of a stream cost (``streamed``). Which kind of
round comes next — drafted, plain, or the server decoding alone — is ``client.loop.schedule``'s question.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate

from client.loop.costs import GAIN, CostCurve, verify_request_bytes
from shared.lookup import paying_length
from shared.payload import PayloadSpec
from shared.tree import DraftTree, depths

# Verification cost is learned from the sizes actually sent, so sizes must vary: the first rounds
# send these shares of the tree, and every EXPLORE_EVERY-th round one of them again.
EXPLORE = (0.5, 0.25)
EXPLORE_EVERY = 8
# ... of the tree's first EXPLORE_SPAN x the nodes worth sending by the costs known so far (the server's Load before a
# round is measured): around the best size, not the whole tree where each node is dear (a CPU target on its low-bit
# kernels, where a node costs a good share of a step)
EXPLORE_SPAN = 4
# The first trees' depth; each round's grows to one past the deepest node that paid. Shallow first: where a
# draft step costs a good share of a target step (a CPU target on its low-bit kernels), a deep first tree
# costs more than its tokens are worth, and it grows in a few rounds where depth pays (a slow link).
START_DEPTH = 3
PAYLOAD_SHARE = 0.05  # a payload may take this share of a round before a smaller one is chosen
UNMEASURED_STEP_S = 0.005  # a server's step before one was measured: a fast one, so a first stream's payloads are small
STREAM_SHARE = 0.5  # a stream's payloads may take this share of the downlink's time per streamed token
PROMPT_SHARE = 0.05  # seconds a prompt's payload may take on a link whose round trip is not yet measured
UNMEASURED_COPY = 0.5  # an offline copy's chance of surviving before any was measured: copies of offline text loop


def outcomes(tree: DraftTree, calibration: float = 1.0, greedy: bool = True) -> list[tuple[int, float]]:
    """The verdicts to draft ahead for, likeliest first: (leaf, the chance its whole path is accepted by the drafter's
    calibrated probabilities); [(-1, 1.0)] for an empty tree. Greedy, the end of the drafter's own first choices
    (each node's first child, ``chain_of_firsts``) comes first: a greedy target takes a node only where it is its own
    first choice too, which a good drafter's first choice is far more often than its probability says; then the
    other leaves by probability. Only leaves: after one any token may be the bonus, so the drafter's own first guesses
    there are worth drafting from; a verdict that stops inside the tree has a bonus the tree lacked at that node,
    which the same guesses would only repeat. A tree without probabilities (a copy) is one chain."""
    if tree.scores is None or not tree.tokens:
        return [((tree.chain_of_firsts() or [-1])[-1], 1.0)]
    parents = set(tree.parents)
    leaves = sorted((i for i in range(len(tree)) if i not in parents), key=lambda i: -tree.scores[i])
    if greedy:
        chain = tree.chain_of_firsts()[-1]
        leaves = [chain] + [i for i in leaves if i != chain]
    return [(i, min(1.0, calibration * math.exp(tree.scores[i]))) for i in leaves]


def likeliest_outcome(tree: DraftTree, calibration: float = 1.0, greedy: bool = True) -> tuple[int, float]:
    """The first of ``outcomes``."""
    return outcomes(tree, calibration, greedy)[0]


@dataclass
class Decision:
    """What ``Sizing.size`` chose for a round: send the tree's first ``nodes`` nodes, expecting ``expected_gain``
    tokens in ``expected_round_s``. ``kind``: "best" (the modelled optimum), "explore" (a fixed share, to learn the
    cost curve; not judged as drafting), "copy" (a copy's length that pays) or "pinned"; ``deepest``: the depth of
    the deepest node sent; ``depth``: the next tree's drafting depth this round argues for (0: none)."""

    nodes: int
    expected_gain: float
    expected_round_s: float
    kind: str = "best"
    deepest: int = 0
    depth: int = 0


@dataclass
class Sizing:
    """The per-round cost model and the sizes it chooses. ``specs``: the payload specs the drafter may use, most
    faithful first; ``raw_bytes_per_token(spec)`` sizes them. ``pin_nodes``/``pin_depth``/``pin_spec`` fix a
    choice instead of adapting it."""

    link: object  # client.net.link.LinkMonitor (or None for a local verifier)
    max_nodes: int = 64
    max_depth: int = 8
    min_depth: int = 2
    specs: list[PayloadSpec] = field(default_factory=list)
    raw_bytes_per_token: Callable[[PayloadSpec], float] | None = None
    pin_nodes: int | None = None
    pin_depth: int | None = None
    pin_spec: PayloadSpec | None = None
    verify_fit: CostCurve = field(default_factory=CostCurve)
    draft_step_s: float | None = None
    calibration: float = 1.0
    depth: int = 0  # the next tree's drafting depth
    rounds: int = 0  # rounds sized by the model (explorations included): the exploration schedule's clock
    history: list[Decision] = field(default_factory=list)
    token_s: float | None = None  # server compute per streamed token (running average)
    load: object = None  # the server's latest ``Load`` (its costs and what it prefers); None: not told
    # the drafter drafted the round before (so it has fed every token but that round's): a drafted round's time is
    # then its levels'; after plain rounds, a stream or a copied draft it also feeds every token it missed
    current: bool = False
    pipelined: bool = False  # the loop drafts the next tree while a Verify is in flight
    chained: bool = False  # ... and sends it before that Verify's verdict (chained rounds)
    hit: float = 0.8  # of the rounds whose likeliest path was accepted, the share whose bonus was among the guesses
    # of the rounds that could chain, the share that sent the next round before the verdict (running average): a
    # chained round goes out only where drafting ahead beats the verdict and leaves a tree to send, so the sizing
    # counts on none it has not seen sent (counting on it anyway, it chose trees too small to send a chained one)
    sent: float = 0.0
    ahead_s: float | None = None  # drafting ahead, a round (running average)
    # the drafter's first choices the target was asked about, per round (``firsts``): [taken, their probabilities
    # summed] as running averages ([] until measured); ``copies``: the same for copied drafts, counted
    choices: list[float] = field(default_factory=list)
    copies: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.depth = self.depth or self.pin_depth or min(self.max_depth, START_DEPTH)

    # --- estimates ---

    def transfer_s(self, up_bytes: float, down_bytes: float) -> tuple[float, float]:
        """(round trip, transfer) seconds on the link as measured; zero without a link."""
        if self.link is None:
            return 0.0, 0.0
        rtt = self.link.srtt_s or 0.0
        return rtt, self.link.transfer_s(int(up_bytes), int(down_bytes))

    def round_s(self, nodes: int, down_bytes: float, draft_levels: int | None = None) -> float:
        """A round that sends ``nodes`` nodes and receives ``down_bytes``, its tree drafted ``draft_levels`` deep
        (default: the next tree's depth)."""
        verify = self.verify_s(nodes)
        draft = (self.draft_step_s or 0.0) * (self.depth if draft_levels is None else draft_levels)
        rtt, transfer = self.transfer_s(verify_request_bytes(nodes), down_bytes)
        return draft + verify + rtt + transfer

    def verify_s(self, nodes: int) -> float:
        """A verification of ``nodes`` nodes: as measured (the cost curve), else by the costs the server reports
        (``Load``), else a streamed token's compute."""
        if self.verify_fit.n:
            return self.verify_fit(nodes + 1, default=0.0)
        load = self.load
        if load is not None and (load.step_s or load.node_s):
            return load.step_s + (nodes + 1) * load.node_s
        return self.token_s or UNMEASURED_STEP_S

    def exposed_s(self, draft_s: float, taken: float, wire_s: float) -> float:
        """What drafting ``draft_s`` a round adds to it: all of it, or when pipelined, only where the guess fails
        (the verdict drafted ahead for, ``likeliest_outcome``, has chance ``taken``; the bonus may be missed) plus
        any drafting ahead that outlasts the wire (``wire_s``)."""
        if not self.pipelined:
            return draft_s
        held = min(1.0, taken) * self.hit
        late = max(0.0, (draft_s if self.ahead_s is None else self.ahead_s) - wire_s)
        return (1 - held) * draft_s + held * late

    def chain_s(self, nodes: int, round_s: float, taken: float, draft_s: float) -> float:
        """A round of ``round_s`` when its chained predecessor's guess failed; where it held (chance ``taken`` of the
        path, times ``hit``), it was sent during that round and is verified straight after it: it costs only the
        longer of its verification and the drafting ahead that sends the next one, in the share ``sent`` of rounds
        that went out chained. Not chained: ``round_s``."""
        if not self.chained:
            return round_s
        held = min(1.0, taken) * self.hit * self.sent
        ahead = draft_s if self.ahead_s is None else self.ahead_s
        return (1 - held) * round_s + held * max(self.verify_s(nodes), ahead)

    def payload_per_token(self, spec: PayloadSpec) -> float:
        """Raw payload bytes per token in ``spec`` (0: unsized)."""
        return self.raw_bytes_per_token(spec) if self.raw_bytes_per_token and spec else 0.0

    # --- the choices (none of them changes what was learnt) ---

    def size(self, tree: DraftTree, spec: PayloadSpec = PayloadSpec()) -> Decision:
        """How many of ``tree``'s first nodes to send, ``spec`` the payload their features come in: the most expected
        tokens per second, or an exploration's fixed share, or the pinned size."""
        if self.pin_nodes is not None or not tree.tokens or (tree.scores is None and tree.kept is None):
            n = len(tree) if self.pin_nodes is None else min(self.pin_nodes, len(tree))
            return Decision(n, float("nan"), float("nan"), "pinned")
        if tree.scores is None:
            return self._copy(tree, spec)
        rounds = self.rounds + 1
        explore = rounds - 1 if rounds <= len(EXPLORE) else None
        if explore is None and rounds % EXPLORE_EVERY == 0:
            explore = (rounds // EXPLORE_EVERY) % len(EXPLORE)
        if explore is None:
            return self._best(tree, spec)
        span = min(len(tree), EXPLORE_SPAN * max(1, self._best(tree, spec).nodes))
        n = max(1, math.ceil(EXPLORE[explore] * span))
        gain = 1.0 + self.calibration * sum(map(math.exp, tree.scores[:n]))
        return Decision(n, gain, float("nan"), "explore", max(depths(tree.parents[:n]), default=0))

    def _copy(self, tree: DraftTree, spec: PayloadSpec) -> Decision:
        """A copy (prompt lookup): as many of its tokens as give the most expected tokens a second, by the chance of
        each being kept (``tree.kept``: earlier copies held against the text that came) and what a round of that size
        costs here. It cost no drafting, and needs no exploring: copies cut short are scored all the same."""
        payload = self.payload_per_token(spec)
        gains = list(accumulate(tree.kept, initial=1.0))
        seconds = [self.round_s(n, gain * payload, draft_levels=0) for n, gain in enumerate(gains)]
        n = paying_length(tree.kept, seconds)
        return Decision(n, gains[n], seconds[n], "copy", n)

    def _best(self, tree: DraftTree, spec: PayloadSpec) -> Decision:
        """The size of the most expected tokens per second by the costs known so far, and the depth to draft next."""
        payload, step, levels = self.payload_per_token(spec), self.draft_step_s or 0.0, depths(tree.parents)
        drafted = max(levels)
        best, best_rate, best_gain, cumulative = 0, 0.0, 1.0, 0.0
        deep, deepest, deepest_rate = 0, 0, 0.0  # the levels a cut keeps; the best cut had each level cost its step
        for n in range(0, len(tree) + 1):
            if n:
                cumulative += math.exp(tree.scores[n - 1])
                deep = max(deep, levels[n - 1])
            gain = 1.0 + self.calibration * cumulative
            wire = self.round_s(n, gain * payload, draft_levels=0)
            taken = likeliest_outcome(tree.head(n), self.calibration)[1] if self.pipelined else 0.0
            cost = self.chain_s(n, wire + self.exposed_s(step * drafted, taken, wire), taken, step * drafted)
            rate = gain / cost if cost > 0 else gain
            if rate > best_rate * (1 + 1e-9):
                best, best_rate, best_gain = n, rate, gain
            cost = self.chain_s(n, wire + self.exposed_s(step * deep, taken, wire), taken, step * deep)
            rate = gain / cost if cost > 0 else gain
            if rate > deepest_rate * (1 + 1e-9):
                deepest, deepest_rate = deep, rate
        depth = deepest + 1 if deepest >= drafted else deepest  # every level drafted pays: try one more
        return Decision(best, best_gain, best_gain / best_rate if best_rate else 0.0, "best",
                        max(depths(tree.parents[:best]), default=0), depth)  # fmt: skip

    def round_spec(self, expected_tokens: float | None = None, budget_s: float | None = None) -> PayloadSpec | None:
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
            if self.transfer_s(0, size)[1] <= budget:
                return spec
        return min(sized, key=lambda pair: pair[1])[0]

    def stream_spec(self) -> PayloadSpec | None:
        """The payload spec for a stream: the most faithful whose bytes take at most ``STREAM_SHARE`` of the
        downlink at the rate tokens stream (payloads must not throttle the stream); None: no choice to make. On a link
        whose rate is not measured yet the smallest (a first stream's payload then measures it, ``observe_gap``)."""
        unmeasured = self.link is not None and self.link.down_rate is None
        if unmeasured and self.specs and self.pin_spec is None and self.raw_bytes_per_token:
            return min(self.specs, key=self.raw_bytes_per_token)  # an unmeasured link may be slow: the smallest first
        step = self.token_s or self.verify_fit(1, default=UNMEASURED_STEP_S)  # the server's pace: a stream's own
        return self.round_spec(1.0, STREAM_SHARE * step)  # rate may be bound by its payloads

    def prompt_spec(self, prompt_tokens: int) -> PayloadSpec | None:
        """The payload spec for a prompt's features: the most faithful whose download takes at most a round trip
        (``PROMPT_SHARE`` s before the link is measured); None: no choice to make."""
        rtt = self.link.srtt_s if self.link is not None else None
        return self.round_spec(float(prompt_tokens), max(PROMPT_SHARE, rtt or 0.0))

    # --- learning from what happened ---

    def observe(self, decision: Decision | None, sent: DraftTree, accepted: int, compute_s: float, draft_s: float,
                depth: int) -> None:  # fmt: skip
        """A round: ``decision`` (None: a plain round, nothing drafted), the tree ``sent`` as the server verified it,
        ``accepted`` of its nodes kept, ``compute_s`` of server time, ``draft_s`` drafting ``depth`` levels."""
        if decision is not None:
            self.history.append(decision)
            if decision.kind in ("best", "explore"):
                self.rounds += 1
            if decision.kind == "best" and self.pin_depth is None:
                self.depth = max(self.min_depth, min(self.max_depth, decision.depth))
        if compute_s > 0:
            self.verify_fit.add(len(sent) + 1, compute_s)
        if depth > 0 and (self.current or self.draft_step_s is None):
            step = draft_s / depth
            self.draft_step_s = step if self.draft_step_s is None else (1 - GAIN) * self.draft_step_s + GAIN * step
        self.current = depth > 0
        if sent.scores:
            predicted = sum(math.exp(s) for s in sent.scores)
            if predicted > 0.05:
                ratio = min(3.0, max(0.2, accepted / predicted))
                self.calibration = (1 - GAIN) * self.calibration + GAIN * ratio

    def firsts(self, sent: DraftTree, accepted: list[int]) -> None:
        """A lesson for offline generation from a tree whose verdict is known (a verified round's, or a rehearsal's
        against the streamed tokens): along the drafter's first choices (``chain_of_firsts``), each one the target
        was asked about — the first, and each after one it took — taken or not, against the drafter's probability
        of it; for a copy (no probabilities: prompt lookup), taken or not. (All of a tree's nodes say how far its
        path probabilities can be trusted, ``calibration``; an offline token is always a first choice, of which a
        drafter is often surer than it should be.)"""
        taken, parent, hits, asked = set(accepted), 0.0, 0.0, 0.0
        for node in sent.chain_of_firsts():
            asked += 1.0 if sent.scores is None else math.exp(sent.scores[node] - parent)
            if node not in taken:
                break
            hits, parent = hits + 1, 0.0 if sent.scores is None else sent.scores[node]
        if asked:  # per round, so that the order of a round's hits and its miss weighs nothing
            tally = self.copies if sent.scores is None else self.choices
            tally[:] = [hits, asked] if not tally else [(1 - GAIN) * tally[0] + GAIN * hits,
                                                         (1 - GAIN) * tally[1] + GAIN * asked]  # fmt: skip

    def survival(self, p: float | None) -> float:
        """The chance that an offline token is the target's own: the drafter's probability ``p`` of it scaled by how
        often the target took its first choices against how sure of them it was; for a copy (``p`` None), how often
        the target took copies (``UNMEASURED_COPY`` until one was)."""
        if p is None:
            return self.copies[0] / self.copies[1] if self.copies else UNMEASURED_COPY
        return min(1.0, p * self.choices[0] / self.choices[1]) if self.choices else p

    def ahead(self, path_taken: bool, held: bool, seconds: float, sent: bool = False) -> None:
        """A pipelined round: its likeliest path was accepted (``path_taken``), its next tree was ready (``held``),
        drafting ahead took ``seconds``, the next round went out chained (``sent``)."""
        if path_taken:
            self.hit = (1 - GAIN) * self.hit + GAIN * float(held)
        if self.chained:
            self.sent = (1 - GAIN) * self.sent + GAIN * float(sent)
        self.ahead_s = seconds if self.ahead_s is None else (1 - GAIN) * self.ahead_s + GAIN * seconds

    def streamed(self, tokens: int, compute_s: float) -> None:
        """A stretch of a stream: ``tokens`` decoded by the server in ``compute_s`` of its compute (its pace)."""
        self.current = False
        if tokens > 0 and compute_s > 0:
            step = compute_s / tokens
            self.token_s = step if self.token_s is None else (1 - GAIN) * self.token_s + GAIN * step

    def loaded(self, load) -> None:
        """The server's latest ``Load``, from any reply that carried one (None: this one did not)."""
        self.load = load or self.load
