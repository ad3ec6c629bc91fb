"""The adaptive policy's choices follow its cost model (``client.loop.sizing``: slow links buy bigger trees, costly
nodes smaller ones) and its schedule follows what drafting and plain decoding measured (``client.loop.schedule``)."""

from __future__ import annotations

import math

import pytest

from client.loop.adaptive import (
    AdaptivePolicy,
    Ahead,
    Loaded,
    Pipelining,
    Rehearsal,
    Round,
    State,
    StaticPolicy,
    Streamed,
)
from client.loop.costs import GAIN, LineFit
from client.loop.schedule import MEASURE, MIN_REHEARSALS, PAUSE, TRIAL, TRIAL_MARGIN, Phase, Schedule
from client.loop.sizing import EXPLORE, EXPLORE_SPAN, Decision, Sizing
from shared.payload import PayloadSpec
from shared.tree import DraftTree


class FakeLink:
    """A link monitor with a fixed RTT and rate (bytes/s both ways)."""

    def __init__(self, rtt_s: float, rate: float | None):
        self.srtt_s, self.rate, self.down_rate = rtt_s, rate, rate

    def transfer_s(self, up: int, down: int) -> float:
        return (up + down) / self.rate


def ranked_tree(probabilities: list[float]) -> DraftTree:
    """A chain whose node i has path probability probabilities[i] (non-increasing, as EAGLE-2 ranks)."""
    tree = DraftTree.chain(list(range(10, 10 + len(probabilities))))
    tree.scores = [math.log(p) for p in probabilities]
    return tree


def trained(policy: AdaptivePolicy, verify_base: float, per_node: float) -> AdaptivePolicy:
    """Feed the policy past its exploration rounds with a server whose verify time is base + per_node·n."""
    for n in (1, 8, 16, 4, 12):
        policy.sizing.verify_fit.add(n + 1, verify_base + per_node * (n + 1))
    policy.sizing.rounds = len(EXPLORE)  # exploration done
    policy.sizing.draft_step_s = 0.01
    return policy


def cut(policy: AdaptivePolicy, tree: DraftTree) -> DraftTree:
    """What the policy sends of ``tree``, told back to it as sent (as the decode loop does, nothing accepted)."""
    decision = policy.size(tree)
    policy.sizing.observe(decision, tree.head(decision.nodes), 0, 0.0, 0.0, 0)
    return tree.head(decision.nodes)


def drafted(policy: AdaptivePolicy, tokens: int, seconds: float = 0.074, nodes: int = 16) -> None:
    """A drafted round of ``nodes`` nodes gaining ``tokens``: 44 ms verifying, 30 ms drafting 3 levels."""
    accepted, decision = list(range(tokens - 1)), Decision(nodes, tokens, seconds)  # (TREE is a chain)
    policy.observe(Round(decision, TREE.head(nodes), accepted, tokens, 0.044, 0.030, 3, seconds))


def plain(policy: AdaptivePolicy, seconds: float = 0.012) -> None:
    """A plain round: one token in ``seconds``."""
    policy.observe(Round(Decision(0, 1.0, seconds, "pinned"), DraftTree(), [], 1, seconds, 0.0, 0, seconds, False))


ROUND = State(prompt_tokens=16, generated=8)  # the loop's state between rounds
STREAMING = State(prompt_tokens=16, generated=8, streaming=True)  # a stretch of a stream is over
TREE = ranked_tree([0.9, 0.8, 0.7, 0.55, 0.45, 0.35, 0.25, 0.18, 0.12, 0.08, 0.05, 0.03, 0.02, 0.01, 0.005, 0.002])


def test_line_fit_recovers_a_line_and_falls_back_to_the_mean():
    fit = LineFit()
    assert fit(10, default=7.0) == 7.0
    fit.add(5, 1.0)
    assert fit(100, default=0.0) == pytest.approx(1.0)  # one x seen: no slope yet
    for x in (1, 2, 3, 9):
        fit.add(x, 0.5 + 0.1 * x)
    fit.add(5, 1.0)
    assert fit(20, default=0.0) == pytest.approx(2.5, rel=0.05)


def test_a_slow_link_makes_the_policy_send_more_of_the_tree():
    fast = trained(AdaptivePolicy(FakeLink(0.001, 1e8)), verify_base=0.05, per_node=0.004)
    slow = trained(AdaptivePolicy(FakeLink(0.300, 2e5)), verify_base=0.05, per_node=0.004)
    n_fast, n_slow = fast.size(TREE).nodes, slow.size(TREE).nodes
    assert 1 <= n_fast < n_slow
    assert n_slow >= 8


def test_costlier_nodes_make_the_policy_send_less():
    cheap = trained(AdaptivePolicy(FakeLink(0.02, 1e7)), verify_base=0.05, per_node=0.0005)
    dear = trained(AdaptivePolicy(FakeLink(0.02, 1e7)), verify_base=0.05, per_node=0.02)
    assert dear.size(TREE).nodes < cheap.size(TREE).nodes


def test_the_cut_maximises_the_modelled_rate_and_keeps_a_tree():
    policy = trained(AdaptivePolicy(FakeLink(0.03, 1e7)), verify_base=0.05, per_node=0.003)
    gain = lambda n: 1 + sum(math.exp(s) for s in TREE.scores[:n])  # noqa: E731
    rate = lambda n: gain(n) / policy.sizing.round_s(n, 0.0, draft_levels=len(TREE))  # noqa: E731 (drafting spent)
    sent = cut(policy, TREE)
    assert rate(len(sent)) == pytest.approx(max(rate(n) for n in range(len(TREE) + 1)))
    assert sent.tokens == TREE.tokens[: len(sent)] and sent.parents == TREE.parents[: len(sent)]


def test_the_next_depth_is_the_cut_that_pays_for_its_drafting():
    """This round's drafting is spent; the next tree is drafted as deep as the best cut had each level cost its step
    (a chain: its depth is its nodes), one level deeper where every level drafted paid."""
    for step, tree in ((0.01, TREE), (0.03, TREE), (0.0, TREE.head(4))):
        policy = trained(AdaptivePolicy(FakeLink(0.03, 1e7)), verify_base=0.05, per_node=0.003)
        policy.sizing.draft_step_s = step
        gain = lambda n: 1 + sum(math.exp(s) for s in tree.scores[:n])  # noqa: E731, B023
        paying = max(range(len(tree) + 1), key=lambda n: gain(n) / policy.sizing.round_s(n, 0.0, draft_levels=n))  # noqa: B023
        sent = cut(policy, tree)
        assert paying <= len(sent)  # the spent drafting buys at least as much of this tree
        sizing = policy.sizing
        deeper = 1 if paying == len(tree) else 0
        assert policy.sizing.depth == min(sizing.max_depth, max(sizing.min_depth, paying + deeper)), step
    dear, cheap = (trained(AdaptivePolicy(FakeLink(0.03, 1e7)), verify_base=0.05, per_node=0.003) for _ in range(2))
    dear.sizing.draft_step_s, cheap.sizing.draft_step_s = 0.03, 0.001
    cut(dear, TREE), cut(cheap, TREE)
    assert dear.sizing.depth < cheap.sizing.depth


def test_a_chained_round_whose_guess_held_costs_no_round_trip():
    """Chained, a round whose predecessor's guess held was sent during that round and is verified straight after it:
    it costs the longer of its verification and the drafting ahead, not a round trip more; where the guess fails it
    costs what an unchained pipelined round does. Unchained, or not pipelined at all, nothing changes."""
    def policy(on: bool, chained: bool) -> AdaptivePolicy:
        p = trained(AdaptivePolicy(FakeLink(0.1, 1e7)), verify_base=0.05, per_node=0.003)
        p.sizing.ahead_s = 0.03
        p.observe(Pipelining(on, chained))
        p.sizing.hit = p.sizing.sent = 1.0
        return p

    chained, piped = policy(True, True), policy(True, False)
    sure = ranked_tree([0.999**k for k in range(1, 17)])
    assert chained.size(sure).expected_round_s < piped.size(sure).expected_round_s - 0.05  # the 0.1 s RTT, hidden
    s = chained.sizing
    assert s.chain_s(8, 0.3, 1.0, 0.01) == pytest.approx(max(s.verify_s(8), 0.03))
    assert s.chain_s(8, 0.3, 0.0, 0.01) == 0.3  # a path never taken: no round sent during it
    assert s.chain_s(8, 0.3, 0.5, 0.01) == pytest.approx(0.5 * 0.3 + 0.5 * s.verify_s(8))
    assert piped.sizing.chain_s(8, 0.3, 1.0, 0.01) == 0.3
    assert not policy(False, True).sizing.chained  # chained rounds are pipelined ones


def test_the_sizing_counts_only_on_chained_rounds_it_has_seen_sent():
    """A chained round goes out only where drafting ahead beats the verdict and leaves a tree to send: until rounds
    are seen sent, a chained sizing prices rounds as an unchained one (counting on them, it chose trees too small for a
    chained round ever to be sent), and it learns the share sent from the rounds that could chain."""
    p = trained(AdaptivePolicy(FakeLink(0.1, 1e7)), verify_base=0.05, per_node=0.003)
    p.observe(Pipelining(True, True))
    s = p.sizing
    s.hit, s.ahead_s = 1.0, 0.03
    assert s.chain_s(8, 0.3, 1.0, 0.01) == 0.3
    p.observe(Ahead(path_taken=True, held=True, seconds=0.03, sent=True))
    assert s.sent == pytest.approx(GAIN)
    assert s.chain_s(8, 0.3, 1.0, 0.01) == pytest.approx((1 - GAIN) * 0.3 + GAIN * max(s.verify_s(8), 0.03))
    p.observe(Ahead(path_taken=False, held=False, seconds=0.03))  # could chain, went out unchained
    assert s.sent == pytest.approx((1 - GAIN) * GAIN)
    unchained = trained(AdaptivePolicy(FakeLink(0.1, 1e7)), verify_base=0.05, per_node=0.003)
    unchained.observe(Pipelining(True, False))
    unchained.observe(Ahead(path_taken=True, held=True, seconds=0.03, sent=True))
    assert unchained.sizing.sent == 0.0  # rounds that could not chain say nothing of the share


def test_pipelined_drafting_costs_only_where_the_guess_fails():
    """Pipelined rounds hide a held guess's drafting behind the wire: a dear draft step sends as much of the tree as a
    free one would where the drafter is sure of its path, and the exposed drafting grows as the path's chance falls."""
    def sizing(pipelined: bool, step: float) -> AdaptivePolicy:
        policy = trained(AdaptivePolicy(FakeLink(0.03, 1e7)), verify_base=0.05, per_node=0.003)
        policy.sizing.draft_step_s, policy.sizing.ahead_s = step, 5 * step
        policy.observe(Pipelining(pipelined))
        policy.sizing.hit = 1.0
        return policy

    sure = ranked_tree([0.999 ** k for k in range(1, 17)])
    free, dear, piped = sizing(False, 0.0), sizing(False, 0.02), sizing(True, 0.02)
    assert dear.size(sure).nodes <= piped.size(sure).nodes == free.size(sure).nodes
    assert piped.size(sure).expected_round_s < dear.size(sure).expected_round_s
    s = piped.sizing
    assert s.exposed_s(0.1, 0.99, 0.2) < s.exposed_s(0.1, 0.5, 0.2) < s.exposed_s(0.1, 1e-4, 0.2)
    assert s.exposed_s(0.1, 1.0, 0.02) == pytest.approx(0.1 - 0.02)  # a sure guess: only what ahead (0.1) outlasts
    assert dear.sizing.exposed_s(0.1, 1.0, 0.2) == 0.1  # not pipelined: all of it
    piped.observe(Ahead(path_taken=True, held=False, seconds=0.1))
    assert piped.sizing.hit < 1.0
    piped.observe(Ahead(path_taken=False, held=False, seconds=0.1))  # a path not taken: nothing said of the bonus
    assert piped.sizing.hit == pytest.approx(1.0 - GAIN)


def test_exploration_rounds_vary_the_size_then_pins_hold():
    policy = AdaptivePolicy(FakeLink(0.01, 1e7))
    assert policy.size(TREE).nodes == policy.size(TREE).nodes  # a question: asking twice changes nothing
    sizes = [len(cut(policy, TREE)) for _ in EXPLORE]
    assert sizes == [math.ceil(share * len(TREE)) for share in EXPLORE]
    pinned = AdaptivePolicy(FakeLink(0.01, 1e7), pin_nodes=3, pin_depth=4)
    assert len(cut(pinned, TREE)) == 3 and pinned.sizing.depth == 4


def test_explorations_span_the_size_the_servers_costs_make_worth_sending():
    """Before any round is measured the server's Load prices the nodes: where they are dear (a CPU's low-bit kernels,
    a node 0.4 of a step) a trial explores around the few nodes worth it, not half of a 48-node tree; where they are
    nearly free (a GPU) it explores shares of the whole tree, as with no costs known."""
    from shared.wire import splitspec_pb2 as pb

    tree = ranked_tree([0.9 * 0.8**i for i in range(48)])
    cpu = AdaptivePolicy(FakeLink(0.03, 1e7))
    cpu.observe(Loaded(pb.Load(sessions=1, step_s=0.027, node_s=0.0107, prefer="latency")))
    gpu = AdaptivePolicy(FakeLink(0.03, 1e7))
    gpu.observe(Loaded(pb.Load(sessions=1, step_s=0.010, node_s=0.00002, prefer="latency")))
    for share in EXPLORE:
        best = cpu.sizing._best(tree, PayloadSpec()).nodes
        assert 0 < best < 12
        assert len(cut(cpu, tree)) == math.ceil(share * min(len(tree), EXPLORE_SPAN * best)) < 24
    assert [len(cut(gpu, tree)) for _ in EXPLORE] == [math.ceil(share * len(tree)) for share in EXPLORE]


def test_calibration_follows_what_was_accepted():
    policy = AdaptivePolicy(None)
    sent = TREE.head(6)
    predicted = sum(math.exp(s) for s in sent.scores)
    for _ in range(30):
        policy.sizing.observe(None, sent, accepted=1, compute_s=0.1, draft_s=0.05, depth=5)
    assert policy.calibration == pytest.approx(1 / predicted, rel=0.05)
    assert policy.sizing.draft_step_s == pytest.approx(0.01)


def test_a_draft_step_is_learnt_from_rounds_with_nothing_to_catch_up():
    """A drafted round after plain rounds (or a stream, or a copied draft) first feeds the drafter every token it
    missed: its drafting time is not its levels' cost, and the depth chosen by that cost would be too shallow."""
    sizing, tree = AdaptivePolicy(None).sizing, TREE.head(3)
    sizing.observe(None, tree, accepted=1, compute_s=0.1, draft_s=0.030, depth=3)  # nothing known yet: learnt
    assert sizing.draft_step_s == pytest.approx(0.01)
    for before in (lambda: sizing.observe(None, DraftTree(), 0, 0.05, 0.0, 0), lambda: sizing.streamed(8, 0.1)):
        before()  # a plain round, a stream
        sizing.observe(None, tree, accepted=1, compute_s=0.1, draft_s=0.300, depth=3)  # catching up 24 tokens
        assert sizing.draft_step_s == pytest.approx(0.01)
    sizing.observe(None, tree, accepted=1, compute_s=0.1, draft_s=0.060, depth=3)  # after a drafted round
    assert sizing.draft_step_s == pytest.approx(0.8 * 0.01 + 0.2 * 0.02)


def test_a_trial_is_judged_by_its_rounds_together():
    """A trial's first round also catches the drafter up: the trial's rate is its tokens over its time, not a running
    average that would weigh that round four times the next."""
    schedule = Schedule(Sizing(None), mode="draft")
    schedule.plain_seen = 50.0
    schedule.drafted(3, 0.1, nodes=4, explored=False)  # 30 tok/s, catching up
    schedule.drafted(8, 0.1, nodes=8, explored=False)  # 80 tok/s: 55 together, a running average's 40
    assert schedule.drafted_rate == pytest.approx(55.0) and schedule.phase is Phase.TRIAL  # drafting goes on
    losing = Schedule(Sizing(None), mode="draft", plain_seen=50.0)
    losing.drafted(3, 0.1, nodes=4, explored=False)
    losing.drafted(6, 0.1, nodes=8, explored=False)  # 45 tok/s together
    assert losing.phase is Phase.PAUSE and losing.left == PAUSE


def test_payload_choice_drops_precision_only_when_the_link_is_slow():
    options = [PayloadSpec("lsa", p, 1, "moa-tli1") for p in ("fp16", "int8", "int4")]
    size = {"fp16": 1920.0, "int8": 960.0, "int4": 480.0}

    def policy(rate: float) -> AdaptivePolicy:
        link = FakeLink(0.05, rate)
        return AdaptivePolicy(link, specs=options, raw_bytes_per_token=lambda s: size[s.precision])

    assert policy(5e6).sizing.round_spec(3.0).precision == "fp16"  # 4G-like: 6 KB is ~1 ms
    assert policy(3e4).sizing.round_spec(3.0).precision == "int4"  # 240 kbit/s: even int4 is over budget: the smallest
    assert AdaptivePolicy(None, pin_spec=options[1]).sizing.round_spec() is options[1]


def test_streams_and_prompts_get_the_payload_their_link_can_carry():
    """A stream's payloads must keep pace with its tokens; a prompt's may take about a round trip."""
    options = [PayloadSpec("lsa", p, 1, "moa-tli1") for p in ("fp16", "int8", "int4")]
    size = {"fp16": 1920.0, "int8": 960.0, "int4": 480.0}

    def policy(rtt_s: float, rate: float) -> AdaptivePolicy:
        policy = AdaptivePolicy(FakeLink(rtt_s, rate), specs=options, raw_bytes_per_token=lambda s: size[s.precision])
        policy.sizing.token_s = 0.0125  # the server's compute per streamed token: the pace payloads must keep
        return policy

    assert policy(0.03, 2.5e6).sizing.stream_spec().precision == "fp16"  # 4G: 1.9 KB a token is 0.8 ms of 12.5 ms
    assert policy(0.3, 2e5).sizing.stream_spec().precision == "int8"  # 3G: 4.8 ms of 12.5 ms; fp16 would take 9.6
    assert policy(0.03, 2.5e6).sizing.prompt_spec(100).precision == "int8"  # 192 KB is 77 ms > 50 ms; 96 KB fits
    assert policy(0.3, 2e5).sizing.prompt_spec(100).precision == "int4"  # 48 KB is 0.24 s < one 0.3 s round trip
    # a link whose rate nobody measured may be 3G: a first stream (which carries the prompt's features) goes small
    assert policy(0.3, None).sizing.stream_spec().precision == "int4"


def test_drafting_is_not_tried_where_a_round_trip_alone_loses_to_streaming():
    """3G's 300 ms round trip: even a depth-3 tree wholly accepted and free gains 4 tokens a round, 13 tok/s, below
    the 80 tok/s stream: auto streams on without a trial. On 4G's 30 ms it may pay: the trial runs."""
    for rtt_s, trial in ((0.3, False), (0.03, True)):
        policy = AdaptivePolicy(FakeLink(rtt_s, 1e6))
        assert policy.plan(ROUND).stream == PAUSE
        policy.observe(Streamed(PAUSE, 0.0, PAUSE / 80.0))
        assert policy.schedule.hopeless() is not trial
        assert (policy.plan(ROUND).stream == 0) is trial
    policy = AdaptivePolicy(FakeLink(0.03, 1e6))
    policy.schedule.plain_seen = 80.0
    policy.schedule.drafted_gain = 1.4  # a drafter that rarely hits: at best 2.8 tokens a 30 ms round, 93 tok/s ...
    policy.sizing.draft_step_s = 0.003  # ... and drafting 3 levels takes 9 ms: 72 tok/s < 80, no more trials
    assert policy.schedule.hopeless()
    policy.schedule.drafted_gain = 3.0
    assert not policy.schedule.hopeless()


def test_a_trial_that_turns_hopeless_stops_at_once_even_in_its_explorations():
    """On 4G a trial starts (a depth-3 tree could beat the 80 tok/s stream); its first round — an exploration, not
    judged as drafting — gains one token after 9 ms of drafting: at best 2 tokens a ~40 ms round, below the stream.
    Mode auto streams on at once, for the longest stretch, instead of finishing the trial."""
    from client.loop.schedule import MAX_PAUSE

    policy = AdaptivePolicy(FakeLink(0.03, 1e6))
    assert policy.plan(ROUND).stream == PAUSE
    policy.observe(Streamed(PAUSE, 0.0, PAUSE / 80.0))
    assert policy.plan(ROUND).stream == 0 and policy.schedule.phase is Phase.TRIAL
    decision = policy.size(TREE)
    assert decision.kind == "explore"
    policy.observe(Round(decision, TREE.head(decision.nodes), [], 1, 0.004, 0.009, 3, 0.045, True))
    assert policy.schedule.hopeless() and policy.plan(ROUND).stream == MAX_PAUSE


def test_drafting_pauses_while_it_loses_to_plain_steps_and_is_tried_again():
    """Local verification (no link) on a machine where a drafted round costs more than the tokens it gains: after
    TRIAL drafted rounds the policy measures MEASURE plain rounds (none seen yet), judges, and decodes plain for
    PAUSE rounds, then drafts again (each failed trial lengthens the pause); where drafting pays it only measures.
    A pinned tree size always drafts."""

    def run(accepted: int, rounds: int = TRIAL + MEASURE + PAUSE + TRIAL + 4 * PAUSE + 1) -> list[bool]:
        policy = trained(AdaptivePolicy(None, mode="draft"), verify_base=0.010, per_node=0.002)  # one token: 12 ms
        choices = []
        for _ in range(rounds):
            drafting = policy.plan(ROUND).draft
            assert policy.plan(ROUND).draft == drafting  # a question: asking twice changes nothing
            choices.append(drafting)
            if drafting:  # a 16-node tree: 44 ms of verification and 30 ms of drafting
                drafted(policy, accepted + 1)
            else:
                plain(policy)
        return choices

    losing = run(accepted=2)  # 3 tokens in 74 ms < 1 token in 12 ms
    trial, measured = TRIAL, TRIAL + MEASURE
    assert losing[:trial] == [True] * TRIAL and losing[trial:measured] == [False] * MEASURE
    # judged against the measured plain rounds as the measurement ends: it loses, and the pause follows at once
    assert losing[measured : measured + PAUSE] == [False] * PAUSE
    again = measured + PAUSE
    assert losing[again : again + TRIAL] == [True] * TRIAL  # tried again; a second loss pauses longer: at under
    assert losing[again + TRIAL : again + TRIAL + 4 * PAUSE] == [False] * (4 * PAUSE)  # half the speed, 4x
    winning = run(accepted=10)  # 11 tokens in 74 ms beat 12 ms a token: only the measurement's rounds are plain
    assert winning[trial:measured] == [False] * MEASURE and all(winning[measured:])
    pinned = trained(AdaptivePolicy(None, pin_nodes=4), verify_base=0.010, per_node=0.002)
    for _ in range(TRIAL + 2):
        drafted(pinned, 1)
    assert pinned.plan(ROUND).draft


def test_auto_streams_first_then_keeps_whichever_mode_was_faster():
    """Mode auto: a stretch the server decodes, then a drafting trial judged against it; a losing trial earns a
    longer stretch, a winning one keeps drafting. The schedule's phase says which."""

    def trial(policy, tokens: int) -> None:
        for _ in range(TRIAL):
            assert policy.plan(ROUND).stream == 0 and policy.plan(ROUND).draft
            drafted(policy, tokens)

    losing = trained(AdaptivePolicy(None), verify_base=0.010, per_node=0.002)
    assert losing.plan(ROUND).stream == PAUSE and losing.schedule.phase is Phase.PAUSE
    losing.observe(Streamed(PAUSE, 0.0, PAUSE * 0.012))  # streamed at 83 tok/s
    assert losing.plan(STREAMING).stream == 0 and losing.schedule.phase is Phase.TRIAL
    trial(losing, 3)  # 40 tok/s
    assert losing.plan(ROUND).stream == PAUSE
    losing.observe(Streamed(PAUSE, 0.0, PAUSE * 0.012))
    trial(losing, 3)
    assert losing.plan(ROUND).stream == 4 * PAUSE  # each lost trial lengthens the stretch: x4 when under half the speed
    winning = trained(AdaptivePolicy(None), verify_base=0.010, per_node=0.002)
    assert winning.plan(ROUND).stream == PAUSE
    winning.observe(Streamed(PAUSE, 0.0, PAUSE * 0.012))
    trial(winning, 11)  # 149 tok/s
    assert winning.plan(ROUND).stream == 0 and winning.schedule.phase is Phase.TRIAL
    assert AdaptivePolicy(None, mode="stream").plan(ROUND).stream > 10**6
    assert AdaptivePolicy(None, mode="draft").plan(ROUND).stream == 0
    with pytest.raises(ValueError, match="mode must be one of auto, draft, stream, got 'fast'"):
        AdaptivePolicy(None, mode="fast")


def test_a_busy_server_is_spared_when_drafting_costs_it_less_per_token():
    """``Load.prefer == "capacity"``: draft instead of streaming when a tree's nodes per token gained cost the server
    less than its decoding would — by its reported costs: on a GPU-like server (a node is nearly free) yes, on a CPU
    whose every token is arithmetic no."""
    from shared.wire import splitspec_pb2 as pb

    policy = trained(AdaptivePolicy(None), verify_base=0.010, per_node=0.002)
    policy.observe(Streamed(PAUSE, 0.0, PAUSE * 0.012))
    for _ in range(TRIAL):  # a 16-node tree gaining 3 tokens, slower than streaming: the trial is lost
        drafted(policy, 3)
    assert policy.schedule.phase is Phase.PAUSE and policy.plan(ROUND).stream == PAUSE
    policy.observe(Loaded(pb.Load(sessions=16, step_s=0.010 / 16, node_s=0.00002, prefer="capacity")))  # GPU, batch 16
    assert policy.schedule.spare_server() and policy.plan(ROUND).stream == 0  # drafting despite the lost trial
    policy.observe(Loaded(pb.Load(sessions=16, step_s=0.010 / 16, node_s=0.002, prefer="capacity")))  # a CPU, batch 16
    assert not policy.schedule.spare_server() and policy.plan(ROUND).stream > 0
    policy.observe(Loaded(pb.Load(sessions=1, step_s=0.010, node_s=0.0001, prefer="latency")))
    assert not policy.schedule.spare_server()


def test_a_convex_cost_curve_is_read_as_measured():
    """A CPU's verify cost: flat for a few tokens, then steep. The curve interpolates what was measured (a line
    through all sizes would price 4 nodes at ~2x one token), so the cut sends the cheap small tree."""
    from client.loop.costs import CostCurve

    costs = {1: 0.013, 2: 0.0135, 5: 0.018, 9: 0.030, 17: 0.060}
    curve = CostCurve()
    for n, s in costs.items():
        curve.add(n, s)
    assert curve(5, 0.0) == pytest.approx(0.018)
    assert curve(3, 0.0) == pytest.approx(0.0135 + (0.018 - 0.0135) / 3)
    assert curve(33, 0.0) >= 0.060  # beyond the largest measured: the line, never cheaper than what was seen
    policy = AdaptivePolicy(None)
    for n, s in costs.items():
        policy.sizing.verify_fit.add(n, s)
    policy.sizing.rounds, policy.sizing.draft_step_s = len(EXPLORE), 0.0005
    assert 3 <= policy.size(TREE).nodes <= 5  # 4 nodes: 2.6 expected tokens for 1.4x a plain step


def test_rehearsals_predict_drafting_from_trees_never_sent():
    """Trees drafted during a stream and scored against the tokens that came: a drafter whose first two nodes are
    always right beats a 100 tok/s stream on a 5 ms link; one that is never right does not (no trial)."""
    def policy(path: list[int]) -> AdaptivePolicy:
        p = AdaptivePolicy(FakeLink(0.005, 1e7))
        p.schedule.plain_seen, p.sizing.token_s = 100.0, 0.008
        for _ in range(MIN_REHEARSALS):
            p.observe(Rehearsal(DraftTree.chain([1, 2, 3, 4]), path, 0.002))
        return p.schedule

    assert AdaptivePolicy(FakeLink(0.005, 1e7)).schedule.rehearsed_rate() is None  # none yet: the old bound rules
    right = policy([0, 1])
    assert right.rehearsed_rate() == pytest.approx(3 / (0.002 + 0.005 + 0.008 + 28 / 1e7), rel=0.01)
    assert not right.hopeless()
    wrong = policy([])
    assert wrong.rehearsed_rate() < 100 and wrong.hopeless()
    # a close call is not worth a trial: predicted drafting must beat the stream by TRIAL_MARGIN
    right.plain_seen = right.rehearsed_rate() / (1 + (TRIAL_MARGIN - 1) / 2)
    assert right.hopeless()
    right.plain_seen = right.rehearsed_rate() / (TRIAL_MARGIN + 0.05)
    assert not right.hopeless()


def test_a_run_starts_from_what_the_previous_run_learnt():
    """``for_run(previous=...)``: a second run of the same pair keeps the first one's costs and calibration, but a new
    prompt may be another kind of text (code after chat): in mode draft it starts with a trial, and a trial it loses
    pauses it for ``PAUSE``, not for the long pause the first run's losses had earned."""

    class Local:  # what for_run reads of a verifier
        link = None
        payload_bytes_per_token = None

    first = trained(AdaptivePolicy.for_run(Local(), []), verify_base=0.010, per_node=0.002)
    assert first.schedule.mode == "draft"  # in process: drafted or plain rounds, never streams
    for _ in range(TRIAL + MEASURE + 3):  # a losing trial, its measurement, then 3 rounds into the pause
        drafted(first, 3) if first.plan(ROUND).draft else plain(first)
    assert first.schedule.phase is Phase.PAUSE and first.schedule.left == PAUSE - 3
    first.schedule.pause = 384  # losses on chat text had grown the next pause
    second = AdaptivePolicy.for_run(Local(), [], previous=first)
    assert second.sizing.calibration == first.sizing.calibration
    choices = []
    for _ in range(TRIAL):
        choices.append(second.plan(ROUND).draft)
        drafted(second, 3)
    assert choices == [True] * TRIAL  # a trial first: this prompt may be code
    assert second.schedule.phase is Phase.PAUSE and second.schedule.left == PAUSE  # lost: a first pause's length
    assert second.sizing.verify_fit(5, 0.0) == first.sizing.verify_fit(5, 0.0)
    assert second.sizing.verify_fit is not first.sizing.verify_fit  # learning on in the second leaves the first alone
    assert second.schedule is not first.schedule and first.schedule.left == PAUSE - 3
    fresh = AdaptivePolicy.for_run(Local(), [])
    assert fresh.plan(ROUND).draft and fresh.schedule.plain_seen is None


def test_the_decode_loop_tells_the_policy_and_never_writes_its_fields():
    """The policy owns its state: the decode loop calls its methods (``plan``, ``size``, ``observe``) and assigns none
    of its attributes (it once set ``load`` and ``token_s``)."""
    import ast
    from pathlib import Path

    def is_policy(node: ast.expr) -> bool:
        return (isinstance(node, ast.Name) and node.id == "policy") or (
            isinstance(node, ast.Attribute) and node.attr == "policy")  # fmt: skip

    root = Path(__file__).resolve().parents[1]
    writes = []
    for name in ("client/loop/decode.py", "client/loop/offline.py", "client/apps/edge_pool.py", "client/apps/cli.py"):
        for node in ast.walk(ast.parse((root / name).read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []  # fmt: skip
            writes += [f"{name}:{node.lineno}" for t in targets if isinstance(t, ast.Attribute) and is_policy(t.value)]
    assert writes == []


def test_the_policys_questions_change_nothing():
    """The policy's questions (what next, at what size, which payload) assign none of its attributes: it learns only
    from what it is told (``observe``). Parsed, so a question that starts
    to change state fails here, whatever the inputs."""
    import ast
    from pathlib import Path

    questions = {"plan", "stretch", "extend", "drafts", "rehearse", "rehearsed_rate", "hopeless", "spare_server",
                 "size", "round_spec", "stream_spec", "prompt_spec", "transfer_s", "round_s", "verify_s",
                 "payload_per_token", "estimate", "calibration"}  # fmt: skip
    root, found, writes = Path(__file__).resolve().parents[1], set(), []
    for name in ("client/loop/adaptive.py", "client/loop/sizing.py", "client/loop/schedule.py"):
        for cls in (n for n in ast.parse((root / name).read_text()).body if isinstance(n, ast.ClassDef)):
            for method in (n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in questions):
                found.add(method.name)
                for node in ast.walk(method):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                        node, (ast.AugAssign, ast.AnnAssign)) else []  # fmt: skip
                    writes += [f"{name}:{node.lineno} {cls.name}.{method.name}" for t in targets
                               if isinstance(t, ast.Attribute)]  # fmt: skip
                    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                            "append", "add", "observe", "drafted", "plain", "_judge"):  # fmt: skip
                        writes.append(f"{name}:{node.lineno} {cls.name}.{method.name} calls {node.func.attr}")
    assert found == questions and writes == []


def test_a_offline_tokens_survival_is_calibrated_by_the_first_choices_the_target_took():
    """A drafter sure of its first choices (0.95 each) whose target takes two and refuses the third: a token made
    offline survives about 2/3 of the time, not 0.95 — the rate the offline cap multiplies. The whole tree's
    calibration is another measure (path probabilities of every node) and is not what is used."""
    policy = AdaptivePolicy(None)
    assert policy.survival(0.9) == 0.9  # nothing measured: the drafter's own word
    sure = ranked_tree([0.95**k for k in range(1, 9)])
    for _ in range(60):
        policy.observe(Round(Decision(8, 3.0, 0.05), sure, [0, 1], 3, 0.04, 0.01, 8, 0.05))
    assert policy.survival(0.95) == pytest.approx(2 / 3, rel=0.02)
    assert policy.survival(1.0) < 0.95 and StaticPolicy().survival(0.9) == 0.9
    assert policy.survival(None) == 0.5  # no copy measured yet: as likely kept as not
    copy = DraftTree.chain([5, 6, 7, 8])  # prompt lookup's: no probabilities; the target takes 1 of the 2 asked
    for _ in range(60):
        policy.observe(Rehearsal(copy, [0], 0.0))  # (a rehearsal's verdict teaches as a round's does)
    assert policy.survival(None) == pytest.approx(0.5, rel=0.02) and policy.survival(0.95) == pytest.approx(2 / 3,
                                                                                                          rel=0.02)


def test_a_trees_deadline_before_any_tree_was_measured_allows_a_step_a_node():
    """After streams only (mode auto's first trial), a Verify's deadline may not assume a 36-node tree costs what a
    streamed token did: on a CPU it costs up to a step a node (0.42 s against a 0.2 s deadline on an AMD Zen 4, where
    every such round ended as a false cut and was never measured). Once the policy has measured trees, their curve
    bounds it."""
    from types import SimpleNamespace

    from client.loop.adaptive import AdaptivePolicy
    from client.loop.costs import CostCurve
    from client.loop.decode import Run
    from client.loop.offline import Resilience
    from shared.acceptance import SamplingParams

    link = SimpleNamespace(timeout_s=lambda: 0.05, transfer_s=lambda up, down: 0.0)
    verifier = SimpleNamespace(link=link, max_context=512)
    policy = AdaptivePolicy(None, mode="auto")
    run = Run(verifier=verifier, drafter=None, prompt_ids=[1, 2, 3], limit=64, sampling=SamplingParams(),
              stop=set(), policy=policy, max_nodes=64, resilience=Resilience())  # fmt: skip
    run.verify_s = 0.027  # a streamed token's compute
    assert run.deadline(36) >= 1.5 * 37 * 0.027
    policy.sizing.verify_fit = CostCurve()
    for n in range(1, 40):
        policy.sizing.verify_fit.add(n, 0.027 + 0.001 * n)  # measured: a GPU-like curve
    assert run.deadline(36) < 0.25


def test_a_copy_is_cut_to_the_length_its_tokens_chances_pay_for_here():
    copy = DraftTree.chain([5, 6, 7, 8, 9, 10])
    copy.kept = [0.2, 0.1, 0.05, 0.03, 0.02, 0.01]  # chat: copies mostly miss at their first token
    dear = trained(AdaptivePolicy(None), verify_base=0.030, per_node=0.008)  # a token adds a quarter of a step
    assert dear.size(copy).nodes == 0  # 1.2 tokens for 1.27x a step's time loses to a plain step
    cheap = trained(AdaptivePolicy(None), verify_base=0.030, per_node=0.0001)  # rows nearly free (a GPU)
    assert cheap.size(copy).nodes == 6
    held = DraftTree.chain([5, 6, 7, 8, 9, 10])
    held.kept = [0.95, 0.9, 0.85, 0.8, 0.76, 0.72]  # code quoting its prompt
    decision = dear.size(held)
    assert (decision.nodes, decision.kind) == (6, "copy")
    assert decision.expected_gain == pytest.approx(1 + sum(held.kept))
    rounds, depth = dear.sizing.rounds, dear.sizing.depth
    dear.observe(Round(decision, held, [0, 1, 2], 4, 0.078, 0.0, 0, 0.08))
    assert (dear.sizing.rounds, dear.sizing.depth) == (rounds, depth)  # a copy moves neither exploration nor depth
    unscored = DraftTree.chain([5, 6, 7])  # a copy of several branches carries no chances: sent whole
    assert dear.size(unscored).nodes == 3
