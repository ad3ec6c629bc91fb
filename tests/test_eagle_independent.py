"""The EAGLE and independent drafters on a tiny random Llama: incremental = batch, lossless output, they learn."""

from __future__ import annotations

import pytest
import torch

from client.drafters import NoDrafter
from client.drafters.eagle import Eagle, EagleConfig, EagleDrafter
from client.drafters.independent import Independent, IndependentConfig, IndependentDrafter
from client.drafters.target_parts import TargetParts
from client.loop.decode import Settings, generate
from client.training.losses import loss as drafter_loss
from client.training.teacher import pad_batch, run_teacher
from client.verifiers import LocalVerifier, first_spec
from shared.acceptance import SamplingParams
from shared.tree import DraftTree, causal_mask

KINDS = ["eagle", "independent"]
PROMPT = [3, 17, 42, 8, 99, 5]
# A draft tree after PROMPT, in feeding order: (token, parent) per node, fed a level at a time.
TREE_LEVELS = [[(23, -1), (40, -1)], [(61, 1), (7, 0)], [(9, 2)]]


def make_model(target, kind: str, seed: int = 0, vocab_ids: torch.Tensor | None = None) -> Eagle | Independent:
    torch.manual_seed(seed)
    parts = TargetParts(target, 0, vocab_ids)
    model = Eagle(EagleConfig.for_target(parts), parts) if kind == "eagle" else Independent(
        IndependentConfig.for_target(parts), parts)  # fmt: skip
    for p in model.parameters():  # random but not tiny, so a wrong mask or position shows in the outputs
        if p.requires_grad and p.dim() > 1:
            torch.nn.init.normal_(p, std=0.2)
    return model.eval()


def make_drafter(model: Eagle | Independent, **options):
    return EagleDrafter(model, **options) if isinstance(model, Eagle) else IndependentDrafter(model, **options)


def target_features(target, ids: list[int]) -> torch.Tensor:
    """The target's final (normed) hidden state of each token, [T, E]."""
    with torch.no_grad():
        return target.reference_model()(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]


def batch_logprobs(target, model, ids: list[int], committed: int) -> torch.Tensor:
    """Next-token log-probs [T, V] of the whole-sequence pass; row t is the distribution of token t+1.

    EAGLE gets the target's true features for the first ``committed`` tokens and its own predicted
    ones after them, as when drafting: the pass is repeated until the predictions settle (one more
    position per pass, the block being causal). Row 0 (no previous feature) is left at zero.
    """
    with torch.no_grad():
        if isinstance(model, Independent):
            positions = torch.arange(len(ids))[None]
            hidden = model(torch.tensor([ids]), positions, causal_mask(len(ids)))[0]
            return torch.log_softmax(model.parts.logits(hidden), -1)
        features = target_features(target, ids)[:-1].clone()  # features[p - 1] goes with token p
        for _ in range(len(ids) - committed + 1):
            out = model.forward_train(features[None], torch.tensor([ids]))[0]  # row p - 1: f̂_p
            features[committed:] = out[committed - 1 : -1]
        rows = torch.log_softmax(model.parts.logits(out), -1)
        return torch.cat([torch.zeros_like(rows[:1]), rows])


@pytest.mark.parametrize("kind", KINDS)
def test_incremental_tree_drafting_matches_the_training_pass(tiny_target, kind):
    """Root and tree-masked expand log-probs equal the whole-sequence pass over each node's path."""
    model = make_model(tiny_target, kind)
    drafter = make_drafter(model)
    session = tiny_target.session(feature_kinds=drafter.feature_kinds)
    drafter.begin(PROMPT, session.prefill(PROMPT[:-1]).features)
    root = len(PROMPT) - 1
    assert torch.allclose(drafter.root_logprobs(), batch_logprobs(tiny_target, model, PROMPT, root)[root], atol=1e-4)
    paths: list[list[int]] = []
    for level in TREE_LEVELS:
        tokens, parents = [t for t, _ in level], [p for _, p in level]
        got = drafter.expand(tokens, parents)
        for row, (token, parent) in zip(got, level, strict=True):
            paths.append(([] if parent < 0 else paths[parent]) + [token])
            ids = PROMPT + paths[-1]
            assert torch.allclose(row, batch_logprobs(tiny_target, model, ids, root)[-1], atol=1e-4), paths[-1]
    drafter.end_tree()


@pytest.mark.parametrize("kind", KINDS)
def test_state_after_verified_rounds_equals_a_fresh_start(tiny_target, kind):
    """After trees, accepted drafts, absorbs and a rewind, the drafter scores the root like one begun afresh."""
    greedy = generate(LocalVerifier(tiny_target), NoDrafter(), PROMPT, 12).token_ids
    model = make_model(tiny_target, kind)
    drafter = make_drafter(model, width=3, depth=3)
    verifier = LocalVerifier(tiny_target)
    opened = verifier.open(PROMPT, SamplingParams(), spec=first_spec(verifier, drafter.payload_specs()))
    drafter.begin(PROMPT + opened.new_tokens, opened.features)
    tokens = PROMPT + opened.new_tokens
    for _ in range(3):
        drafter.propose(6)  # its nodes fill the cache slots after the root
        done = len(tokens) - len(PROMPT)
        result = verifier.verify(DraftTree.chain(greedy[done : done + 2] + [0]))  # two accepted, one not
        assert len(result.accepted) == 2
        drafter.absorb(result.new_tokens, result.features)
        tokens += result.new_tokens
    drafter.rewind(1)  # the bonus token is dropped: the newest token whose features arrived is the new root
    tokens = tokens[:-1]
    fresh = make_drafter(model)
    fresh.begin(tokens, tiny_target.session(feature_kinds=fresh.feature_kinds).prefill(tokens[:-1]).features)
    got, want = drafter.root_logprobs(), fresh.root_logprobs()
    drafter.end_tree()
    fresh.end_tree()
    assert torch.allclose(got, want, atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_a_pruned_vocabulary_drafts_only_its_tokens(tiny_target, kind):
    prompt = [5, 9, 14, 5, 9, 21, 33]
    plain = generate(LocalVerifier(tiny_target), NoDrafter(), prompt, 20)
    vocab = torch.tensor(sorted(set(plain.token_ids)) + [7, 8])  # the right answers among few others
    drafter = make_drafter(make_model(tiny_target, kind, vocab_ids=vocab), width=3, depth=3)
    verifier = LocalVerifier(tiny_target)
    opened = verifier.open(prompt, SamplingParams(), spec=first_spec(verifier, drafter.payload_specs()))
    drafter.begin(prompt + opened.new_tokens, opened.features)
    tree = drafter.propose(8)
    assert len(tree) and set(tree.tokens) <= set(vocab.tolist())
    got = generate(LocalVerifier(tiny_target), drafter, prompt, 20, Settings(max_tree_nodes=8))
    assert got.token_ids == plain.token_ids


@pytest.mark.parametrize("pruned", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_training_steps_lower_the_loss(tiny_target, kind, pruned):
    sequences = [([3, 17, 42, 8, 99, 5, 23, 61, 7, 12], [0] * 4 + [1] * 6), ([5, 9, 14, 5, 9, 21], [0, 0, 1, 1, 1, 1])]
    vocab = torch.arange(0, 200, 2) if pruned else None  # a draft vocabulary: teacher and drafter logits index it
    tb = run_teacher(tiny_target, *pad_batch(sequences), vocab_ids=vocab)
    model = make_model(tiny_target, kind, vocab_ids=vocab).train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(6):
        loss, metrics = drafter_loss(model, tb, generator)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        assert {"kl", "acc"} <= metrics.keys() and ("feat" in metrics) == (kind == "eagle")
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("kind", KINDS)
def test_trainable_state_holds_no_target_weights(tiny_target, kind):
    model = make_model(tiny_target, kind)
    state = model.trainable_state()
    assert state and not any(k.startswith("parts.") for k in state)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert sum(v.numel() for v in state.values()) == trainable
    frozen = {p.data_ptr() for p in model.parts.parameters()}
    assert not frozen & {v.data_ptr() for v in state.values()}


def test_drafters_without_context_propose_nothing(tiny_target):
    eagle = make_drafter(make_model(tiny_target, "eagle"))
    eagle.begin([5])  # no previous feature for the root
    assert len(eagle.propose(8)) == 0
    eagle.begin([5, 9, 14])  # no features sent
    assert len(eagle.propose(8)) == 0
    independent = make_drafter(make_model(tiny_target, "independent"))
    independent.begin([5])
    assert len(independent.propose(0)) == 0
    assert len(independent.propose(4)) == 4
