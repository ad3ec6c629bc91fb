"""The server's cut of trees at load (``server.budget``): what it learns, when it cuts, and that a cut tree
still gives exactly the target's tokens."""

from __future__ import annotations

import threading

import pytest

from server.batching import Batcher
from server.budget import MIN_FORWARDS, MIN_PATHS, REFIT_EVERY, Tree, TreeBudget
from shared.acceptance import SamplingParams
from shared.engine.models import load_target
from shared.tree import DraftTree


def seen_paths(budget: TreeBudget) -> TreeBudget:
    """``budget``, having seen 16-node trees accept their first nodes often and later ones rarely."""
    paths = [[0, 1, 2], [0, 1], [0], [], [0, 1, 2, 3], [0, 1], [0, 4], [0, 5, 9, 15]]  # the last node pays, rarely
    for i in range(MIN_PATHS * 2):
        budget.observe_path(16, paths[i % len(paths)])
    return budget


def timed(budget: TreeBudget, per_token_s: float, fixed_s: float = 0.02, forwards: int = MIN_FORWARDS * 2):
    """``budget``, having timed ``forwards`` forwards costing ``fixed_s`` + ``per_token_s`` a token."""
    for i in range(forwards):
        tokens = 17 * (1 + i % 16)
        budget.observe_forward(tokens, tokens * 100, fixed_s + per_token_s * tokens)
    return budget


def trained(per_token_s: float, fixed_s: float = 0.02, min_nodes: int = 1) -> TreeBudget:
    """A budget that has seen those trees and forwards costing ``fixed_s`` + ``per_token_s`` a token."""
    return timed(seen_paths(TreeBudget(min_nodes)), per_token_s, fixed_s)


def test_it_learns_what_a_trees_head_would_have_accepted():
    budget = TreeBudget()
    for _ in range(MIN_PATHS):
        budget.observe_path(8, [0, 2, 5])  # accepted nodes 0, 2 and 5 of 8
    assert [budget.accepted(j) for j in range(9)] == [0, 1, 1, 2, 2, 2, 3, 3, 3]
    assert budget.accepted(9) is None  # no tree that long was seen
    for _ in range(500):
        budget.observe_path(4, [])  # 20 of the first fall out of its window of 512: 12 are left
    assert budget.accepted(8) is None and budget.accepted(4) == pytest.approx(12 * 2 / 512)


def test_it_cuts_nothing_until_it_knows_and_where_nodes_are_cheap():
    trees = [Tree(16, 300) for _ in range(16)]
    assert TreeBudget().choose(trees, 0, 0) is None  # nothing seen yet
    assert trained(per_token_s=1e-7).choose(trees, 0, 0) is None  # weights-bound: every node is nearly free


def test_a_prior_cuts_from_the_first_forward_until_the_servers_own_fit_says_otherwise():
    """A fresh server knows its path's costs from the path timing (``Target.costs``): with them it cuts a busy
    forward's trees at once, where without them its first 32 forwards verified every node (a 16-client run of 64
    tokens makes ~20). Its own forwards' fit then replaces the prior, and an implausible fit falls back to it."""
    trees = [Tree(16, 300) for _ in range(16)]
    budget = seen_paths(TreeBudget(prior=(0.02, 1e-3)))
    k = budget.choose(trees, 0, 0)
    assert k is not None and 1 <= k < 16 and k == trained(per_token_s=1e-3).choose(trees, 0, 0)
    timed(budget, per_token_s=1e-7, forwards=MIN_FORWARDS - 1)
    assert budget.choose(trees, 0, 0) == k  # not yet enough of its own
    timed(budget, per_token_s=1e-7, forwards=REFIT_EVERY)
    assert budget.choose(trees, 0, 0) is None  # its forwards say nodes are nearly free
    for _ in range(MIN_FORWARDS * 8):  # time falls as tokens grow: no plausible line
        budget.observe_forward(17, 1700, 1.0)
        budget.observe_forward(272, 27200, 0.5)
    assert budget.choose(trees, 0, 0) == k and not budget.compute_bound()
    assert seen_paths(TreeBudget(prior=(0.02, 0.0))).choose(trees, 0, 0) is None  # free tokens: nothing to cut
    with pytest.raises(ValueError, match="both >= 0"):
        TreeBudget(prior=(-1.0, 1e-3))


def test_it_cuts_where_tokens_cost_and_less_for_clients_away_longer():
    busy = trained(per_token_s=1e-3)
    k = busy.choose([Tree(16, 300) for _ in range(16)], 0, 0)
    assert k is not None and 1 <= k < 16
    away = busy.choose([Tree(16, 300, away_s=5.0) for _ in range(16)], 0, 0)
    assert away is None or away >= k  # a round's server time matters less to a client away for seconds
    assert trained(per_token_s=1e-3, min_nodes=6).choose([Tree(16, 300)] * 16, 0, 0) in (None, *range(6, 16))
    assert trained(per_token_s=1e-3, min_nodes=1000).choose([Tree(16, 300)] * 16, 0, 0) is None


@pytest.fixture(scope="module")
def bf16(tiny_model_dir):
    return load_target(str(tiny_model_dir), dtype="bfloat16")


def test_cut_trees_still_give_exactly_the_targets_tokens(bf16):
    """Sessions verifying 6-node trees through a batcher that cuts every tree to its first node: the tokens are
    those of verifying whole trees alone (greedy), and each verdict says how many nodes it verified."""
    prompts = [[5, 9, 14, 5, 9, 21, 33], list(range(5, 45)), [7, 8, 9]]

    def decode(prompt, run=None):
        session, verdicts = bf16.session(SamplingParams()), []
        session.prefill(prompt, run=run)
        while len(session.tokens) < len(prompt) + 24:
            g = session.tokens[-1]
            tree = DraftTree([g, (g + 1) % bf16.vocab_size, g, g, (g + 2) % bf16.vocab_size, g], [-1, -1, 0, 1, 2, 4])
            verdicts.append(session.verify(tree, run=run))
        return session.tokens[: len(prompt) + 24], verdicts

    alone = [decode(p)[0] for p in prompts]
    budget = TreeBudget()
    budget.choose = lambda trees, tokens, pairs: 1  # as a loaded server would: the first node only
    batcher = Batcher(bf16.engine, max_batch=4, window_s=0.05, budget=budget)
    results: list = [None] * len(prompts)
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, decode(prompts[i], batcher.run)))
               for i in range(len(prompts))]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    batcher.close()
    for (tokens, verdicts), want in zip(results, alone, strict=True):
        assert tokens == want
        assert {v.verified_nodes for v in verdicts} == {1} and all(v.accepted in ([], [0]) for v in verdicts)
    cut = [v for _, verdicts in results for v in verdicts]  # it was told of every cut path, and what it accepted
    assert len(cut) >= MIN_PATHS and budget.accepted(1) == pytest.approx(sum(len(v.accepted) for v in cut) / len(cut))
    assert len(budget._paths) == sum(len(v) for _, v in results)


def test_a_remote_client_is_told_of_the_cut_and_gets_the_same_tokens(bf16):
    """Through gRPC: the reply says how many nodes were verified, the client counts those, the tokens are the
    target's as with whole trees, and the server's metrics count the nodes it cut."""
    from client.drafters import make_drafter
    from client.loop.decode import generate
    from client.net.remote import RemoteVerifier
    from client.verifiers import LocalVerifier
    from tests.conftest import start_server

    prompt = [5, 6, 7, 8] * 6  # prompt lookup drafts long chains from it
    local = generate(LocalVerifier(bf16), make_drafter("prompt-lookup"), prompt, 24)
    server, address, service = start_server(bf16, max_sessions=2, max_tree_nodes=16, max_context=128)
    service.batcher.budget.choose = lambda trees, tokens, pairs: 1
    remote = RemoteVerifier(address)
    try:
        gen = generate(remote, make_drafter("prompt-lookup"), prompt, 24)
    finally:
        remote.close()
        server.stop(grace=None)
        service.close()
    assert gen.token_ids == local.token_ids
    assert max(local.stats.tree_nodes) > 1 and max(gen.stats.tree_nodes) == 1
    assert service.metrics.tree_nodes_cut._value.get() > 0
