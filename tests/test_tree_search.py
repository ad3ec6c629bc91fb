"""EAGLE-2 tree search on a toy drafter whose next-token distribution depends on the whole path."""

from __future__ import annotations

import math

import pytest
import torch

from client.drafters.tree_search import chain_draft, eagle2_tree
from shared.tree import ROOT, DraftTree, ancestor_mask, depths, path_to, validate_tree

V = 50
CONTEXT = (7, 3)  # committed tokens, the root last
CASES = [(1, 1, 1), (2, 3, 5), (3, 3, 8), (3, 4, 12), (4, 3, 100), (4, 4, 10), (8, 2, 20)]  # width, depth, max_nodes


def toy_logprobs(path: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Log-probabilities [V] of the token after ``path``: a fixed pseudo-random function of the full path."""
    generator = torch.Generator().manual_seed(hash((seed, *path)) % 2**62)
    return torch.log_softmax(3.0 * torch.randn(V, generator=generator), dim=-1)


class ToyScorer:
    """A TreeScorer over ``toy_logprobs`` that records its calls and checks that the search feeds it correctly."""

    def __init__(self, seed: int = 0, fail_on_expand: bool = False):
        self.seed, self.fail_on_expand = seed, fail_on_expand
        self.draft: list[tuple[int, ...]] = []  # drafted tokens from the root down to each node fed in this tree
        self.fed_ever: list[tuple[int, ...]] = []
        self.expand_sizes: list[int] = []
        self.root_calls = self.end_calls = 0

    def logprobs(self, draft: tuple[int, ...]) -> torch.Tensor:
        return toy_logprobs(CONTEXT + draft, self.seed)

    def root_logprobs(self) -> torch.Tensor:
        assert not self.draft, "draft state was not rewound before a new tree"
        self.root_calls += 1
        return self.logprobs(())

    def expand(self, tokens: list[int], parents: list[int]) -> torch.Tensor:
        assert self.root_calls == self.end_calls + 1, "expand outside a tree"
        assert len(tokens) == len(parents) > 0
        self.expand_sizes.append(len(tokens))
        if self.fail_on_expand:
            raise RuntimeError("drafter broke")
        before = len(self.draft)
        for token, parent in zip(tokens, parents, strict=True):
            assert ROOT <= parent < before, f"parent {parent} is not an already-fed node ({before} fed)"
            self.draft.append((() if parent == ROOT else self.draft[parent]) + (token,))
        self.fed_ever += self.draft[before:]
        return torch.stack([self.logprobs(draft) for draft in self.draft[before:]])

    def end_tree(self) -> None:
        self.end_calls += 1
        self.draft = []


class TableScorer:
    """A TreeScorer with given root log-probabilities and the same next-token log-probabilities after any node."""

    def __init__(self, root: list[float], after: list[float]):
        self.root, self.after = torch.tensor(root), torch.tensor(after)
        self.expand_sizes: list[int] = []
        self.end_calls = 0

    def root_logprobs(self) -> torch.Tensor:
        return self.root

    def expand(self, tokens: list[int], parents: list[int]) -> torch.Tensor:
        self.expand_sizes.append(len(tokens))
        return self.after.expand(len(tokens), -1)

    def end_tree(self) -> None:
        self.end_calls += 1


def node_paths(tree: DraftTree) -> list[tuple[int, ...]]:
    """Drafted tokens from the root's child down to each node."""
    return [tuple(tree.tokens[j] for j in path_to(tree.parents, i)) for i in range(len(tree))]


def path_score(draft: tuple[int, ...], seed: int = 0) -> float:
    """Cumulative log-probability of a drafted path, by brute force: one toy call per step."""
    return sum(toy_logprobs(CONTEXT + draft[:k], seed)[token].item() for k, token in enumerate(draft))


def reference_eagle2(width: int, depth: int, max_nodes: int, seed: int = 0):
    """EAGLE-2 straight from its definition, over token paths; returns ({kept path: score}, frontier paths fed)."""

    def top_children(draft: tuple[int, ...]) -> list[tuple[int, ...]]:
        return [draft + (t,) for t in toy_logprobs(CONTEXT + draft, seed).topk(width).indices.tolist()]

    candidates = level = top_children(())
    fed: set[tuple[int, ...]] = set()
    for _ in range(2, depth + 1):
        frontier = sorted(level, key=lambda p: -path_score(p, seed))[:width]
        fed.update(frontier)
        level = [child for node in frontier for child in top_children(node)]
        candidates = candidates + level
    kept = sorted(candidates, key=lambda p: (-path_score(p, seed), len(p)))[:max_nodes]
    return {p: path_score(p, seed) for p in kept}, fed


@pytest.mark.parametrize("width, depth, max_nodes", CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_tree_shape_and_size(width, depth, max_nodes, seed):
    scorer = ToyScorer(seed)
    tree, scores = eagle2_tree(scorer, width, depth, max_nodes)
    validate_tree(tree.tokens, tree.parents, vocab_size=V, max_nodes=max_nodes)
    assert all(p < i for i, p in enumerate(tree.parents))
    assert max(depths(tree.parents)) <= depth
    assert len(tree) == len(scores) == min(max_nodes, width + (depth - 1) * width**2)
    assert scores == sorted(scores, reverse=True)  # rank order
    assert len(set(node_paths(tree))) == len(tree)  # siblings are distinct tokens
    assert scorer.root_calls == scorer.end_calls == 1
    assert len(scorer.expand_sizes) <= depth - 1 and all(n <= width for n in scorer.expand_sizes)


@pytest.mark.parametrize("width, depth, max_nodes", CASES)
def test_scores_are_cumulative_logprobs(width, depth, max_nodes):
    tree, scores = eagle2_tree(ToyScorer(), width, depth, max_nodes)
    for draft, score in zip(node_paths(tree), scores, strict=True):
        assert score == pytest.approx(path_score(draft), abs=1e-9)


@pytest.mark.parametrize("width, depth, max_nodes", CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_brute_force_eagle2(width, depth, max_nodes, seed):
    scorer = ToyScorer(seed)
    tree, scores = eagle2_tree(scorer, width, depth, max_nodes)
    expected, expected_fed = reference_eagle2(width, depth, max_nodes, seed)
    assert dict(zip(node_paths(tree), scores, strict=True)) == pytest.approx(expected, abs=1e-9)
    assert set(scorer.fed_ever) <= expected_fed  # only frontier nodes are fed (fewer when the search stops early)


def test_full_search_feeds_every_frontier():
    """With room for every candidate nothing is skipped: each depth's whole frontier is fed, once."""
    scorer = ToyScorer()
    eagle2_tree(scorer, width=3, depth=4, max_nodes=1000)
    _, expected_fed = reference_eagle2(3, 4, 1000)
    assert scorer.expand_sizes == [3, 3, 3]
    assert sorted(scorer.fed_ever) == sorted(expected_fed)


def test_prefix_is_the_smaller_tree():
    """Rank order: the first k nodes of a tree are the tree built with max_nodes=k."""
    big, big_scores = eagle2_tree(ToyScorer(), width=4, depth=5, max_nodes=40)
    for k in range(1, 41):
        small, small_scores = eagle2_tree(ToyScorer(), width=4, depth=5, max_nodes=k)
        assert (small.tokens, small.parents, small_scores) == (big.tokens[:k], big.parents[:k], big_scores[:k])


def test_ancestor_mask_rows_are_paths():
    tree, _ = eagle2_tree(ToyScorer(), width=3, depth=4, max_nodes=15)
    mask = ancestor_mask(tree.parents)
    for i in range(len(tree)):
        path = path_to(tree.parents, i)
        assert mask[i + 1].nonzero().flatten().tolist() == [0] + [j + 1 for j in path]
        assert len(path) == depths(tree.parents)[i]


def test_width_one_is_the_greedy_chain():
    draft: tuple[int, ...] = ()
    for _ in range(6):
        draft += (int(toy_logprobs(CONTEXT + draft).argmax()),)
    tree, _ = eagle2_tree(ToyScorer(), width=1, depth=6, max_nodes=6)
    assert (tree.tokens, tree.parents) == (list(draft), [-1, 0, 1, 2, 3, 4])
    scorer = ToyScorer()
    chain = chain_draft(scorer, 6)
    assert (chain.tokens, chain.parents) == (tree.tokens, tree.parents)
    assert scorer.expand_sizes == [1] * 5 and scorer.end_calls == 1


def test_max_nodes_one_is_the_best_root_child_without_expanding():
    scorer = ToyScorer()
    tree, scores = eagle2_tree(scorer, width=8, depth=6, max_nodes=1)
    best = toy_logprobs(CONTEXT).max(dim=0)
    assert (tree.tokens, tree.parents) == ([best.indices.item()], [-1])
    assert scores == [pytest.approx(best.values.item())]
    assert scorer.expand_sizes == [] and scorer.end_calls == 1


def test_stops_expanding_once_nothing_deeper_can_make_the_cut():
    # Root: token 0 is near-certain. After any node: children with probabilities .4, .3, .2, .1.
    root = [math.log(0.97), math.log(0.01), math.log(0.01), math.log(0.01)]
    scorer = TableScorer(root, [math.log(0.4), math.log(0.3), math.log(0.2), math.log(0.1)])
    tree, scores = eagle2_tree(scorer, width=2, depth=5, max_nodes=2)
    # After depth 2 the frontier's best equals the 2nd-best candidate: deeper nodes would rank below it.
    assert scorer.expand_sizes == [2] and scorer.end_calls == 1
    assert (tree.tokens, tree.parents) == ([0, 0], [-1, 0])  # the best root child and its best child, not token 1
    assert scores == pytest.approx([math.log(0.97), math.log(0.97 * 0.4)])


def test_floor_stops_where_the_best_path_becomes_unlikely():
    # Root: token 0 at .9. After any node: .6, .3, .1. Best paths: .9, .54, .324, .19, ...
    root = [math.log(0.9), math.log(0.05), math.log(0.05)]
    after = [math.log(0.6), math.log(0.3), math.log(0.1)]
    deep = TableScorer(root, after)
    eagle2_tree(deep, width=2, depth=6, max_nodes=100)
    assert deep.expand_sizes == [2] * 5  # no floor: every depth
    scorer = TableScorer(root, after)
    tree, scores = eagle2_tree(scorer, width=2, depth=6, max_nodes=100, floor=0.3)
    # frontier bests .9 and .54 and .324 are fed; at .19 the search stops: three expansions, nothing deeper
    assert scorer.expand_sizes == [2, 2, 2] and scorer.end_calls == 1
    assert max(depths(tree.parents)) == 4 and math.exp(max(scores)) == pytest.approx(0.9)


def test_vocab_mask_and_impossible_tokens():
    allowed = torch.zeros(V, dtype=torch.bool)
    allowed[[1, 5, 9]] = True
    tree, scores = eagle2_tree(ToyScorer(), width=4, depth=3, max_nodes=30, vocab_mask=allowed)
    assert set(tree.tokens) <= {1, 5, 9} and len(tree) == 3 + 3 * 3 + 4 * 3  # 3 roots, 9 children, then 4 fed
    assert all(math.isfinite(s) for s in scores)

    scorer = TableScorer([0.0, -math.inf, -math.inf], [-math.inf, -math.inf, 0.0])  # one possible token per step
    tree, scores = eagle2_tree(scorer, width=3, depth=4, max_nodes=10)
    assert (tree.tokens, tree.parents, scores) == ([0, 2, 2, 2], [-1, 0, 1, 2], [0.0] * 4)


class CudaScorer(ToyScorer):
    """ToyScorer's distributions on the GPU, as a drafter there scores them."""

    def logprobs(self, draft: tuple[int, ...]) -> torch.Tensor:
        return super().logprobs(draft).cuda()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the scorer's distributions on another device need CUDA")
def test_a_gpu_scorer_with_a_cpu_vocabulary_and_mask():
    allowed = torch.zeros(V, dtype=torch.bool)
    allowed[[1, 5, 9]] = True
    vocab = torch.arange(V) + 100  # index i of a drafted distribution is token 100 + i
    tree, _ = eagle2_tree(CudaScorer(), width=2, depth=3, max_nodes=8, vocab_mask=allowed, vocab_ids=vocab)
    want, _ = eagle2_tree(ToyScorer(), width=2, depth=3, max_nodes=8, vocab_mask=allowed, vocab_ids=vocab)
    assert tree.tokens == want.tokens and set(tree.tokens) <= {101, 105, 109}


def test_end_tree_is_called_when_expand_raises():
    scorer = ToyScorer(fail_on_expand=True)
    with pytest.raises(RuntimeError, match="drafter broke"):
        eagle2_tree(scorer, width=2, depth=3, max_nodes=6)
    assert scorer.end_calls == 1


@pytest.mark.parametrize("kwargs, message", [
    ({"width": 0}, "width must be >= 1, got 0"),
    ({"depth": -1}, "depth must be >= 1, got -1"),
    ({"max_nodes": 0}, "max_nodes must be >= 1, got 0"),
])  # fmt: skip
def test_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        eagle2_tree(ToyScorer(), **{"width": 2, "depth": 2, "max_nodes": 4, **kwargs})


def test_chain_draft_rejects_empty_length():
    with pytest.raises(ValueError, match="length must be >= 1, got 0"):
        chain_draft(ToyScorer(), 0)


def test_rejects_scores_that_are_not_logprobs():
    scorer = TableScorer([2.0, 1.0], [0.0, -1.0])  # raw logits
    with pytest.raises(ValueError, match="expected log-probabilities"):
        eagle2_tree(scorer, width=2, depth=2, max_nodes=3)
    assert scorer.end_calls == 1
