"""The MoA drafter on a tiny random Llama: exact TLI, K-step-bounded CA, incremental = batch, lossless output."""

from __future__ import annotations

import pytest
import torch

from client.drafters.moa import MoA, MoAConfig, MoADrafter
from client.drafters.target_parts import TargetParts
from shared.features import cache_kv
from shared.tree import causal_mask


def make_moa(target, tli: int, seed: int = 0) -> MoA:
    torch.manual_seed(seed)
    parts = TargetParts(target, tli)
    model = MoA(MoAConfig.for_target(parts, tli), parts)
    for p in model.parameters():  # random but not tiny, so a wrong mask or position shows in the outputs
        if p.requires_grad and p.dim() > 1:
            torch.nn.init.normal_(p, std=0.2)
    return model.eval()


def target_pass(target, ids: torch.Tensor):
    """The target's KV per token [1, T, L, Ekv], hidden states per layer (transformers' convention), logits, cache."""
    T = ids.shape[1]
    cache = target.engine.new_cache(T)
    trace: list[torch.Tensor] = []
    with torch.no_grad():
        final = target.engine(ids, torch.arange(T)[None], causal_mask(T), cache, 0, trace=trace)
    return cache_kv(cache, 0, T)[None], (*trace, final), target.engine.logits(final), cache


@pytest.mark.parametrize("tli", [1, 2])
def test_tli_reproduces_the_target_from_its_own_hidden_state(tiny_target, tli):
    model = make_moa(tiny_target, tli)
    ids = torch.tensor([[3, 17, 42, 8, 99, 5, 23, 61]])
    kv, hidden, logits, cache = target_pass(tiny_target, ids)
    L = tiny_target.num_layers
    entering = hidden[L - tli]
    T = ids.shape[1]
    every, none = torch.arange(T)[None], torch.zeros(1, T, dtype=torch.long)
    segmentations = [every, none, torch.tensor([[0, 0, 0, 3, 3, 5, 5, 5]])]
    for starts in segmentations:
        tli_kv = [(cache.layers[i].k, cache.layers[i].v) for i in range(L - tli, L)]
        out = model.head_train(entering, starts, tli_kv)
        assert torch.allclose(model.parts.logits(out), logits, atol=1e-4), starts


def test_ca_is_k_step_bounded(tiny_target):
    """Changing the memory of tokens at or after a draft's start changes nothing drafted in it."""
    model = make_moa(tiny_target, 0)
    ids = torch.tensor([[3, 17, 42, 8, 99, 5, 23, 61, 7, 12]])
    kv, *_ = target_pass(tiny_target, ids)
    starts = torch.tensor([[0, 1, 2, 3, 3, 3, 3, 7, 7, 7]])
    with torch.no_grad():
        base = model.forward_train(ids, kv, starts)
        changed = kv.clone()
        changed[:, 3:] += torch.randn_like(changed[:, 3:])
        other = model.forward_train(ids, changed, starts)
    assert torch.allclose(base[:, :4], other[:, :4], atol=1e-5)  # drafts that began at or before 3
    assert not torch.allclose(base[:, 4:], other[:, 4:], atol=1e-3)  # later ones saw the changed memory


def test_a_staircase_sequence_takes_its_context_from_the_memory_alone(tiny_target):
    """With the staircase SA mask a draft's outputs depend on the tokens before it only through the target's
    memory: changing those tokens (the memory kept) changes nothing in the draft; without it, they do."""
    model = make_moa(tiny_target, 0)
    ids = torch.tensor([[3, 17, 42, 8, 99, 5, 23, 61, 7, 12]])
    kv, *_ = target_pass(tiny_target, ids)
    starts = torch.tensor([[0, 0, 0, 0, 0, 5, 5, 5, 5, 5]])
    other_ids = ids.clone()
    other_ids[0, 1:4] = torch.tensor([9, 10, 11])
    with torch.no_grad():
        for stairs, same in ((torch.tensor([True]), True), (torch.tensor([False]), False), (None, False)):
            base = model.forward_train(ids, kv, starts, staircase=stairs)
            other = model.forward_train(other_ids, kv, starts, staircase=stairs)
            assert torch.allclose(base[:, 5:], other[:, 5:], atol=1e-5) == same, stairs


@pytest.mark.parametrize("tli", [0, 2])
def test_incremental_drafting_matches_the_training_pass(tiny_target, tli):
    """The drafter's cached, tree-masked root/expand log-probs equal forward_train on the same chain."""
    model = make_moa(tiny_target, tli)
    prompt = [3, 17, 42, 8, 99, 5]
    chain = [23, 61, 7]
    ids = torch.tensor([prompt + chain])
    kv, hidden, logits, cache = target_pass(tiny_target, ids)
    root = len(prompt) - 1
    T = ids.shape[1]
    starts = torch.tensor([[min(t, root) for t in range(T)]])
    L = tiny_target.num_layers
    tli_kv = [(cache.layers[i].k, cache.layers[i].v) for i in range(L - tli, L)]
    with torch.no_grad():
        batch = torch.log_softmax(model.parts.logits(model.head_train(model.forward_train(ids, kv, starts), starts,
                                                                      tli_kv)), -1)[0]  # fmt: skip
    drafter = MoADrafter(model)
    session = tiny_target.session(feature_kinds=("kv",))
    verdict = session.prefill(prompt[:-1])
    drafter.begin(prompt, verdict.features)
    got = [drafter.root_logprobs()]
    parents = [-1]
    for i, token in enumerate(chain[:-1]):
        got.append(drafter.expand([token], [i - 1 if i else -1])[0])
        parents.append(i)
    drafter.end_tree()
    for i, row in enumerate(got):
        assert torch.allclose(row, batch[root + i], atol=1e-4), i
