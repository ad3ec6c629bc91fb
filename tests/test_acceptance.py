"""Acceptance rules: greedy picks the target's argmax path; sampling is exactly the target's distribution."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from shared.acceptance import SamplingParams, accept_tree, argmax, argmaxes, target_probs
from shared.tree import DraftTree, tree_attention_mask, tree_positions

# root -> [0:a, 1:b, 2:c]; a -> [3:d, 4:e]; d -> [5:f]; token ids are chosen below
PARENTS = [-1, -1, -1, 0, 0, 3]
TOKENS = [2, 0, 5, 1, 2, 4]
VOCAB = 6


def chi2_critical(df: int, z: float = 3.29) -> float:
    """Wilson-Hilferty upper quantile of chi-square (z = 3.29: one false alarm in ~2000 runs)."""
    if df < 1:
        raise ValueError(f"chi-square needs >= 1 degree of freedom, got {df}: the distribution is too peaked")
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_statistic(counts: Counter, expected: dict, n: int) -> tuple[float, int]:
    """Pearson's statistic over cells with expected count >= 5; rarer cells are pooled into one."""
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for cell, p in expected.items():
        e = p * n
        if e >= 5:
            stat += (counts.get(cell, 0) - e) ** 2 / e
            cells += 1
        else:
            pooled_obs += counts.get(cell, 0)
            pooled_exp += e
    unexpected = sum(c for cell, c in counts.items() if cell not in expected)
    pooled_obs += unexpected
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / max(pooled_exp, 1e-9)
        cells += 1
    return stat, cells - 1


def two_token_test(rule, logits, continuation, params, n=20000, seed=0) -> tuple[float, float]:
    """Sample (x1, x2) through ``rule`` and compare with the target's own p(x1) p(x2 | x1).

    x2 comes from the same verification when x1 was an accepted node, otherwise from the next
    round, modelled as plain sampling from ``continuation[x1]``.
    """
    g = torch.Generator().manual_seed(seed)
    probs = [target_probs(row, params) for row in logits]
    cont = [target_probs(row, params) for row in continuation]
    root_children = {TOKENS[i]: i for i in range(len(TOKENS)) if PARENTS[i] == -1}
    expected = {}
    for x1 in range(VOCAB):
        p2 = probs[root_children[x1] + 1] if x1 in root_children else cont[x1]
        for x2 in range(VOCAB):
            if probs[0][x1] * p2[x2] > 0:
                expected[(x1, x2)] = (probs[0][x1] * p2[x2]).item()
    counts: Counter = Counter()
    for _ in range(n):
        accepted, bonus = rule(TOKENS, PARENTS, logits, params, g)
        emitted = [TOKENS[i] for i in accepted] + [bonus]
        if len(emitted) == 1:
            emitted.append(int(torch.multinomial(cont[emitted[0]], 1, generator=g)))
        counts[tuple(emitted[:2])] += 1
    stat, df = chi2_statistic(counts, expected, n)
    return stat, chi2_critical(df)


def biased_rule(tokens, parents, logits, params, generator):
    """A classic bug: after rejecting a child, sample the residual without removing it."""
    from shared.tree import children

    kids, accepted, row = children(parents), [], 0
    while True:
        p = target_probs(logits[row], params)
        match = next((c for c in kids[row] if torch.rand((), generator=generator) < p[tokens[c]]), None)
        if match is None:
            return accepted, int(torch.multinomial(p, 1, generator=generator))
        accepted.append(match)
        row = match + 1


PARAMS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.8, seed=3)]


@pytest.mark.parametrize("params", PARAMS, ids=["t1", "t0.7-p0.8"])
def test_speculative_sampling_is_lossless(params):
    torch.manual_seed(1)
    logits = torch.randn(len(TOKENS) + 1, VOCAB) * 1.5
    continuation = torch.randn(VOCAB, VOCAB) * 1.5
    stat, critical = two_token_test(accept_tree, logits, continuation, params)
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}: speculative sampling is biased"


def test_the_statistical_test_catches_a_biased_rule():
    torch.manual_seed(1)
    logits = torch.randn(len(TOKENS) + 1, VOCAB) * 1.5
    continuation = torch.randn(VOCAB, VOCAB) * 1.5
    stat, critical = two_token_test(biased_rule, logits, continuation, SamplingParams(temperature=1.0))
    assert stat > critical, f"a biased rule passed (chi-square {stat:.1f} < {critical:.1f}): the test is too weak"


def test_greedy_walks_the_argmax_path():
    logits = torch.full((len(TOKENS) + 1, VOCAB), -5.0)
    logits[0, 2] = 5  # root -> token 2 = node 0 (a)
    logits[1, 1] = 5  # a -> token 1 = node 3 (d)
    logits[4, 3] = 5  # d -> token 3: not drafted, becomes the bonus
    assert accept_tree(TOKENS, PARENTS, logits, SamplingParams()) == ([0, 3], 3)
    logits[0, 3] = 9  # root -> token 3: no child matches
    assert accept_tree(TOKENS, PARENTS, logits, SamplingParams()) == ([], 3)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="a GPU's transfer"))])  # fmt: skip
def test_argmaxes_read_at_once_are_each_rows_argmax_ties_included(device):
    """A GPU's greedy walk reads a tree's first rows' argmaxes in one transfer (``TreeLogits.greedy``): each must be
    the row's own ``argmax``, the first of equal maxima included, in bf16 (where ties are common) and fp32."""
    gen = torch.Generator().manual_seed(2)
    for dtype in (torch.bfloat16, torch.float32):
        rows = (torch.randn(9, 500, generator=gen) * 3).round().to(dtype)  # many equal values
        rows[3] = 7.0  # all equal: the first index
        rows[5, [17, 400]] = 99.0  # two maxima: the first
        rows = rows.to(device)
        assert argmaxes(rows) == [argmax(r) for r in rows]
        assert argmaxes(rows)[3] == 0 and argmaxes(rows)[5] == 17


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the bulk read is a GPU's")
def test_a_tree_s_greedy_rows_on_a_gpu_are_each_rows_argmax(tiny_model_dir):
    from shared.engine.models import load_target
    from shared.engine.target import TreeLogits

    engine = load_target(str(tiny_model_dir), device="cuda", dtype="bfloat16").engine
    hidden = torch.randn(6, engine.cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    logits = TreeLogits(engine, hidden, [0, 2, 3])
    assert [logits.greedy(r) for r in range(6)] == [argmax(logits[r]) for r in range(6)]


def test_top_p_keeps_the_smallest_nucleus():
    p = target_probs(torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])), SamplingParams(temperature=1.0, top_p=0.7))
    torch.testing.assert_close(p, torch.tensor([0.625, 0.375, 0.0, 0.0]))


def test_sampling_params_are_checked():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(temperature=1, top_p=0)


def test_session_sampling_matches_target_distribution(tiny_target):
    """End to end on a tiny model: tokens emitted by tree verification follow the target's p."""
    params = SamplingParams(temperature=0.3, seed=7)  # peaked enough that drafts get accepted, not one-hot
    model = tiny_target.reference_model()
    prompt = [5, 17, 42, 8, 99, 3]
    session = tiny_target.session(params)
    session.prefill(prompt)
    session.truncate(len(prompt))  # make the prompt's last token the root, with nothing sampled yet
    with torch.no_grad():
        p_root = target_probs(model(torch.tensor([prompt])).logits[0, -1], params)
        top = p_root.topk(3).indices.tolist()
        p_a = target_probs(model(torch.tensor([prompt + [top[0]]])).logits[0, -1], params)
    tree = DraftTree()
    a = tree.add(top[0])
    for t in top[1:]:
        tree.add(t)
    for t in p_a.topk(2).indices.tolist():
        tree.add(t, a)
    assert tree_positions(tree.parents, 5)[1:] == [6, 6, 6, 7, 7] and tree_attention_mask(
        tree.parents, 5, model.dtype, "cpu"
    ).shape == (1, 1, 6, 11)
    n = 3000
    first: Counter = Counter()
    second: Counter = Counter()
    for _ in range(n):
        verdict = session.verify(tree)
        first[verdict.new_tokens[0]] += 1
        if verdict.accepted[:1] == [a]:
            second[verdict.new_tokens[1]] += 1
        session.truncate(len(prompt))
    for counts, p in ((first, p_root), (second, p_a)):
        total = sum(counts.values())
        stat, df = chi2_statistic(counts, {t: v for t, v in enumerate(p.tolist()) if v > 0}, total)
        assert stat < chi2_critical(df), f"chi-square {stat:.1f} over {total} samples"


def test_typical_acceptance_is_greedy_at_temperature_zero():
    torch.manual_seed(0)
    for _ in range(50):
        logits = torch.randn(len(TOKENS) + 1, VOCAB) * 3
        typical = SamplingParams(acceptance="typical")
        assert accept_tree(TOKENS, PARENTS, logits, typical) == accept_tree(TOKENS, PARENTS, logits, SamplingParams())


def test_typical_acceptance_keeps_the_longest_plausible_path():
    """p(x) > min(epsilon, delta * exp(-H)): a plausible second choice is kept, an implausible one is not, and of two
    plausible children the one whose own child is plausible too wins (the longest path)."""
    def row(*probs: float) -> torch.Tensor:
        return torch.tensor(probs).log()

    # root -> [0: token 1, 1: token 2]; node 1 -> [2: token 0]; node 0 has no child
    tokens, parents = [1, 2, 0], [-1, -1, 1]
    rows = torch.stack([row(0.5, 0.3, 0.2), row(0.9, 0.05, 0.05), row(0.6, 0.3, 0.1), row(0.4, 0.3, 0.3)])
    params = SamplingParams(temperature=1.0, acceptance="typical", seed=1)
    accepted, bonus = accept_tree(tokens, parents, rows, params, torch.Generator().manual_seed(0))
    assert accepted == [1, 2]  # token 2 (p 0.2, over the bar 0.09), then token 0 (p 0.6) under it
    # a confident target (p 0.9 / 0.05 / 0.05, H = 0.39, bar min(0.09, 0.3 e^-0.39 = 0.20)): p 0.05 is not kept
    assert accept_tree([1], [-1], rows[1:3], params)[0] == []
    lenient = SamplingParams(temperature=1.0, acceptance="typical", epsilon=0.04)
    assert accept_tree([1], [-1], rows[1:3], lenient)[0] == [0]
    with pytest.raises(ValueError, match="acceptance"):
        SamplingParams(acceptance="medusa")


def test_a_draw_follows_the_weights_and_never_takes_a_weightless_token():
    """``draw`` (inverse CDF, unnormalised weights): frequencies within 6 standard deviations of the weights (seeded,
    so deterministic), a token of weight 0 never, the last token reachable."""
    from shared.acceptance import draw

    weights = torch.tensor([0.2, 0.0, 1.2, 0.0, 0.6])
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(5)
    for _ in range(20000):
        counts[draw(weights, g)] += 1
    assert counts[1] == 0 and counts[3] == 0 and counts[4] > 0
    assert (counts / 20000 - weights / weights.sum()).abs().max() < 6 * (0.25 / 20000) ** 0.5
