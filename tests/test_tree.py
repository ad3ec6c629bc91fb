"""Tree layout and tree verification: one forward over a tree equals running each path alone."""

from __future__ import annotations

import random

import pytest
import torch

from shared.acceptance import SamplingParams
from shared.tree import DraftTree, ancestor_mask, children, depths, path_to, tree_positions, validate_tree


def random_tree(rng: random.Random, n: int, vocab: int) -> DraftTree:
    tree = DraftTree()
    for i in range(n):
        tree.add(rng.randrange(vocab), rng.randrange(-1, i))
    return tree


def test_layout_helpers():
    parents = [-1, 0, 0, -1, 2]
    assert depths(parents) == [1, 2, 2, 1, 3]
    assert children(parents) == [[0, 3], [1, 2], [], [4], [], []]
    assert path_to(parents, 4) == [0, 2, 4]
    assert tree_positions(parents, 10) == [10, 11, 12, 12, 11, 13]
    mask = ancestor_mask(parents)
    assert mask[5].tolist() == [True, True, False, True, False, True]  # node 4 sees root, 0, 2, itself
    assert mask[4].tolist() == [True, False, False, False, True, False]  # node 3 sees root and itself
    assert DraftTree.chain([7, 8, 9]).parents == [-1, 0, 1]


@pytest.mark.parametrize(
    "tokens, parents, message",
    [
        ([1, 2], [-1], "2 tokens but 1 parent"),
        ([1, 2], [-1, 1], "parent index 1 of node 1"),
        ([1, 2], [-1, -2], "parent index -2 of node 1"),
        ([1, 999], [-1, 0], "token id 999 at node 1 is outside the vocabulary"),
        ([1] * 9, [-1] * 9, "9 nodes, over the limit of 8"),
    ],
)
def test_validate_tree_names_the_problem(tokens, parents, message):
    with pytest.raises(ValueError, match=message):
        validate_tree(tokens, parents, vocab_size=100, max_nodes=8)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tree_logits_match_sequential_paths(tiny_target, seed):
    """Every tree node's logits equal those of its root-to-node path run as a plain sequence."""
    rng = random.Random(seed)
    model, vocab = tiny_target.reference_model(), tiny_target.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(3, 20))]
    tree = random_tree(rng, 15, vocab)
    session = tiny_target.session()
    session.prefill(prompt)
    root = session.tokens[-1]

    from shared.tree import tree_mask

    prefix = session.cached_len
    with torch.no_grad():  # the engine's tree forward, checked against transformers run on each path alone
        ids = torch.tensor([[root, *tree.tokens]])
        pos = torch.tensor([tree_positions(tree.parents, prefix)])
        hidden = tiny_target.engine(ids, pos, tree_mask(tree.parents, prefix), session.cache, prefix)
        tree_logits = tiny_target.engine.logits(hidden)[0]
        for node in range(-1, len(tree)):
            path = [] if node == -1 else [tree.tokens[i] for i in path_to(tree.parents, node)]
            seq = torch.tensor([prompt + [root] + path])
            want = model(seq).logits[0, -1]
            torch.testing.assert_close(tree_logits[node + 1], want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_verify_keeps_only_the_accepted_path(tiny_target, seed):
    """After rounds of tree verification the cache equals a fresh prefill of the committed tokens."""
    rng = random.Random(seed)
    vocab = tiny_target.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(8)]
    session = tiny_target.session(SamplingParams())
    session.prefill(prompt)
    for _ in range(4):
        # plant the target's own greedy continuation in a random tree so that some nodes get accepted
        greedy = tiny_target.session()
        greedy.prefill(session.tokens[:-1])
        chain = [greedy.verify(DraftTree()).new_tokens[0] for _ in range(3)]
        tree = random_tree(rng, 6, vocab)
        parent = -1
        for tok in chain:
            parent = tree.add(tok, parent)
        verdict = session.verify(tree)
        assert verdict.accepted and len(verdict.new_tokens) >= 2
        assert session.cached_len == len(session.tokens) - 1
    fresh = tiny_target.session()
    fresh.prefill(session.tokens[:-1])
    n = fresh.cached_len
    assert session.cached_len == n
    torch.testing.assert_close(session.cache.k[:, :, :, :n], fresh.cache.k[:, :, :, :n], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(session.cache.v[:, :, :, :n], fresh.cache.v[:, :, :, :n], atol=1e-4, rtol=1e-4)


def test_follow_walks_the_tokens_a_target_chose_through_the_tree():
    tree = DraftTree([5, 6, 7, 8], [-1, -1, 0, 2])  # 5 -> 7 -> 8, and 6
    assert tree.follow([5, 7, 8, 9]) == [0, 2, 3]
    assert tree.follow([6, 7]) == [1]
    assert tree.follow([9]) == [] and tree.follow([]) == []
