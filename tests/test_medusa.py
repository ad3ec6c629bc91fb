"""Medusa on a tiny random Llama: its heads, its measured sparse tree, lossless drafting, offline reach, its loss,
and self-distilled data (the target's own answers, batched on the serving engine)."""

from __future__ import annotations

import pytest
import torch

from client.drafters import NoDrafter
from client.drafters.medusa import TOP_K, Medusa, MedusaConfig, MedusaDrafter, prior_tree, sparse_tree
from client.drafters.target_parts import TargetParts
from client.loop.decode import Settings, generate
from client.loop.offline import offline_token, settle_verify
from client.net.remote import RemoteVerifier
from client.training.losses import medusa_loss
from client.training.teacher import pad_batch, run_teacher
from client.verifiers import LocalVerifier
from shared.acceptance import SamplingParams
from shared.features import Features
from shared.tree import DraftTree
from tests.test_eagle_independent import target_features
from tests.test_offline import PROMPT as OFFLINE_PROMPT
from tests.test_offline import online_rounds, start

PROMPT = [3, 17, 42, 8, 99, 5]


def make_model(target, seed: int = 0, heads: int = 3) -> Medusa:
    torch.manual_seed(seed)
    parts = TargetParts(target)
    model = Medusa(MedusaConfig.for_target(parts, heads), parts)
    for p in model.parameters():  # random, so that each head drafts something else
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.3)
    return model.eval()


def test_sparse_tree_counts_whole_paths_and_keeps_parents_first():
    ranks = torch.tensor([[0, 0, 0], [0, 0, 1], [0, 1, TOP_K], [1, 0, 0], [0, 0, 0], [TOP_K, 0, 0]])
    tree, probs = sparse_tree(ranks, nodes=5)
    assert tree == [[0], [0, 0], [0, 0, 0], [1], [0, 1]]  # ties: the shallower first
    assert probs == pytest.approx([4 / 6, 3 / 6, 2 / 6, 1 / 6, 1 / 6])
    for path in tree:
        assert len(path) == 1 or tree.index(path[:-1]) < tree.index(path)
    prior, prior_probs = prior_tree(4)
    assert prior[:4] == [[0], [0, 0], [1], [0, 0, 0]] and prior_probs == sorted(prior_probs, reverse=True)
    assert all(len(p) == 1 or p[:-1] in prior[: prior.index(p)] for p in prior)
    with pytest.raises(ValueError, match="ranks"):
        sparse_tree(torch.zeros(0, 3))


def test_a_round_drafts_each_heads_ranked_tokens_along_the_tree(tiny_target):
    model = make_model(tiny_target)
    drafter = MedusaDrafter(model)
    drafter.begin(PROMPT, Features(0, hidden=target_features(tiny_target, PROMPT[:-1])))
    heads = model(target_features(tiny_target, PROMPT)[-2])  # f of the token before the root
    tree = drafter.propose(12)
    assert len(tree) == 12 and len(tree.scores) == 12
    assert tree.scores == sorted(tree.scores, reverse=True)
    paths = [tuple(p) for p in model.cfg.tree]
    for i, (token, parent) in enumerate(zip(tree.tokens, tree.parents, strict=True)):
        path = paths[i]
        assert parent == (-1 if len(path) == 1 else paths.index(path[:-1]))
        assert token == int(heads[len(path) - 1].topk(TOP_K).indices[path[-1]])
    shallow = drafter.propose(30, depth=1)
    assert set(shallow.parents) == {-1} and len(shallow) == TOP_K


def test_heads_of_an_older_state_reach_as_far_as_they_go(tiny_target):
    """Tokens committed without features (offline) spend heads: the next one is drafted by the head that far ahead."""
    model = make_model(tiny_target, heads=3)
    drafter = MedusaDrafter(model)
    drafter.begin(PROMPT, Features(0, hidden=target_features(tiny_target, PROMPT[:-1])))
    heads = model(target_features(tiny_target, PROMPT)[-2])
    first = drafter.propose(1, 1).tokens[0]
    assert first == int(heads[0].argmax())
    drafter.absorb([first])
    assert drafter.propose(1, 1).tokens == [int(heads[1].argmax())]
    drafter.absorb([7])
    assert drafter.propose(1, 1).tokens == [int(heads[2].argmax())]
    drafter.absorb([9])
    assert len(drafter.propose(8)) == 0  # every head spent: nothing to offer until the target's states come back
    drafter.rewind(2)
    assert drafter.propose(1, 1).tokens == [int(heads[1].argmax())]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_medusa_output_equals_plain_decoding(tiny_target, temperature):
    """Greedy: token for token, in fewer rounds. Sampling (whose distribution tests/test_acceptance.py checks): as
    many tokens, the same ones again for the same seed."""
    prompt = [5, 9, 14, 5, 9, 21, 33, 5, 9]
    sampling = SamplingParams(temperature=temperature, seed=3)
    plain = generate(LocalVerifier(tiny_target), NoDrafter(), prompt, 30, Settings(sampling=sampling))
    drafter = MedusaDrafter(make_model(tiny_target))
    got = generate(
        LocalVerifier(tiny_target), drafter, prompt, 30,
        Settings(max_tree_nodes=10, sampling=sampling),
    )
    if temperature == 0:
        assert got.token_ids == plain.token_ids and got.stats.rounds < len(got.token_ids)  # the heads' drafts paid
    else:
        again = generate(
            LocalVerifier(tiny_target), MedusaDrafter(make_model(tiny_target)), prompt, 30,
            Settings(max_tree_nodes=10, sampling=sampling),
        )  # fmt: skip
        assert len(got.token_ids) == len(plain.token_ids) and again.token_ids == got.token_ids


def test_medusa_over_the_network_equals_plain_decoding(tiny_server, tiny_target):
    prompt = [5, 9, 14, 5, 9, 21, 33, 5, 9]
    plain = generate(LocalVerifier(tiny_target), NoDrafter(), prompt, 24)
    drafter = MedusaDrafter(make_model(tiny_target))
    remote = RemoteVerifier(tiny_server[0], drafter=drafter)
    try:
        got = generate(remote, drafter, prompt, 24, Settings(max_tree_nodes=10))
    finally:
        remote.shutdown()
    assert got.token_ids == plain.token_ids
    assert got.stats.payload_bytes > 0  # the heads read the hidden payload


def test_medusa_loss_pairs_head_k_with_the_target_k_tokens_ahead(tiny_target):
    model = make_model(tiny_target, heads=2)
    seqs = [([3, 17, 42, 8, 99, 5, 11, 23], [0, 0, 1, 1, 1, 1, 1, 1]), ([4, 6, 8, 10, 12], [0, 1, 1, 1, 1])]
    tb = run_teacher(tiny_target, *pad_batch(seqs))
    loss, metrics = medusa_loss(model, tb)
    assert loss.requires_grad and torch.isfinite(loss)
    # brute force: head k at trained position (r, c) against the teacher at (r, c + k), where that is trained
    trained = {(int(r), int(c)): i for i, (r, c) in enumerate(zip(tb.rows, tb.cols, strict=True))}
    logits = model(tb.hidden[-1][tb.rows, tb.cols])
    ranks = []
    for i, (r, c) in enumerate(trained):
        rows = [trained.get((r, c + k)) for k in (1, 2)]
        if None not in rows:
            labels = [int(tb.teacher_logits[j].argmax()) for j in rows]
            ranks.append([min(TOP_K, int((logits[k][i] > logits[k][i][labels[k]]).sum())) for k in (0, 1)])
    assert metrics["ranks"].tolist() == ranks and len(ranks) == 5 + 1
    assert 0 <= float(metrics["acc"]) <= 1 and "acc2" in metrics


def test_decode_step_and_pick_equal_a_verification_of_nothing(tiny_target):
    for sampling in (SamplingParams(), SamplingParams(temperature=0.9, seed=5)):
        a, b = tiny_target.session(sampling), tiny_target.session(sampling)
        a.prefill(PROMPT)
        b.prefill(PROMPT)
        for _ in range(6):
            a.verify(DraftTree())
            step = b.decode_step()
            hidden = b.run(step)
            b.pick(tiny_target.engine.logits(hidden[-1:]))
        assert a.tokens == b.tokens and a.cached_len == b.cached_len


def test_offline_medusa_spends_its_heads_then_waits_and_settles_losslessly(tiny_target):
    """Cut off, it commits one token per head from the last state, then offers nothing; verification of that tail
    against the target ends as an uninterrupted run."""
    plain = generate(LocalVerifier(tiny_target), NoDrafter(), OFFLINE_PROMPT, 40).token_ids
    drafter = MedusaDrafter(make_model(tiny_target, heads=3))
    verifier, out = start(tiny_target, drafter)
    online_rounds(verifier, drafter, out, 6)
    tail = [offline_token(drafter) for _ in range(5)]
    assert None not in tail[:3] and tail[3:] == [None, None]
    out += settle_verify(verifier, drafter, tail[:3], max_nodes=2)
    online_rounds(verifier, drafter, out, 34)
    assert out[:34] == plain[:34]


def test_the_adaptive_policy_runs_medusa_over_the_network(tiny_server, tiny_target):
    from client.loop.adaptive import AdaptivePolicy

    prompt = [5, 9, 14, 5, 9, 21, 33, 5, 9]
    plain = generate(LocalVerifier(tiny_target), NoDrafter(), prompt, 24).token_ids
    drafter = MedusaDrafter(make_model(tiny_target))
    remote = RemoteVerifier(tiny_server[0], drafter=drafter)
    try:
        policy = AdaptivePolicy.for_run(remote, drafter.payload_specs(), mode="draft")
        got = generate(remote, drafter, prompt, 24, Settings(policy=policy))
    finally:
        remote.shutdown()
    assert got.token_ids == plain and len(policy.sizing.history) == got.stats.rounds
    assert {spec.form for spec in policy.sizing.specs} == {"hidden"} and got.stats.payload_bytes > 0
