"""bench.probe: drafts cut at every phase, and a MoA without its memory really does not see the target."""

from __future__ import annotations

import torch

from bench.probe import draft_starts, eagle_logits, moa_logits, probe
from bench.single import Prompt
from client.training.teacher import pad_batch, run_teacher
from tests.test_training import make_trainer


def test_every_answer_position_is_scored_at_every_step_it_can_be():
    T, root, K = 40, 9, 6
    starts = draft_starts(T, root, K)
    assert starts.shape == (K, T)
    t = torch.arange(T)
    assert torch.equal(starts[:, :root], t[:root].expand(K, -1))  # prompt positions are never drafted
    answer = starts[:, root:]
    steps = t[root:] - answer + 1
    assert (answer >= root).all() and (steps >= 1).all() and (steps <= K).all()
    for pos in range(root, T):  # the K phases give a position every step from 1 to K, or up to its distance d
        d = pos - root + 1  # from the root; phases whose first draft covers it all see it at step d
        assert sorted(steps[:, pos - root].tolist()) == sorted([*range(1, min(d, K) + 1), *[d] * max(0, K - d)])


def test_without_memory_the_drafts_ignore_the_targets_states(tiny_target, tmp_path):
    model = make_trainer(tiny_target, tmp_path, 100, drafters=[("moa", 0)]).models["moa-tli0"].eval()
    ids = [5, 9, 14, 5, 9, 21, 33, 40, 41, 5, 9, 14, 2, 7]
    input_ids, valid, mask = pad_batch([(ids, [0] * 6 + [1] * 8)])
    tb = run_teacher(tiny_target, input_ids, valid, mask)
    other = run_teacher(tiny_target, input_ids, valid, mask)
    other.keys, other.values = torch.randn_like(tb.keys) * 3, torch.randn_like(tb.values) * 3  # another "target"
    starts = draft_starts(len(ids), 5, 4)
    blind = [moa_logits(model, b, starts, memory=False)[0] for b in (tb, other)]
    seeing = [moa_logits(model, b, starts, memory=True)[0] for b in (tb, other)]
    assert torch.equal(blind[0], blind[1])
    assert (seeing[0] - seeing[1]).abs().max() > 1e-3


def test_probe_scores_each_answer_token_once_per_step(tiny_target, tmp_path):
    trainer = make_trainer(tiny_target, tmp_path, 100, drafters=[("moa", 1), ("eagle", 0), ("independent", 0)])
    drafters = {name: m.eval() for name, m in trainer.models.items()}
    prompts = [Prompt("mt-bench", 0, "x", "x", [5, 9, 14, 5, 9, 21]), Prompt("humaneval", 0, "y", "y", [7, 8, 9])]
    result = probe(tiny_target, drafters, prompts, 12, 4)
    rows = {(r["drafter"], r["condition"]): r for r in result["rows"]}
    memory, blind = rows[("moa-tli1", "memory")], rows[("moa-tli1", "no memory")]
    assert rows[("eagle", "own features")]["positions"] == memory["positions"]
    assert memory["positions"] == blind["positions"] == rows[("independent", "no memory (its kind)")]["positions"]
    assert 0 < memory["positions"] <= 24
    for row in (memory, blind):
        assert all(v is None or 0 <= v <= 1 for v in row["by_step"].values())
    assert set(result["state_rms"]) == {"tli0", "tli1", "tli3"} and all(v > 0 for v in result["state_rms"].values())


def test_eagle_feeds_on_the_targets_features_before_the_root_and_its_own_after(tiny_target, tmp_path):
    model = make_trainer(tiny_target, tmp_path, 100, drafters=[("eagle", 0)]).models["eagle"].eval()
    ids = [5, 9, 14, 5, 9, 21, 33, 40, 41, 5, 9, 14, 2, 7, 8, 11]
    input_ids, valid, mask = pad_batch([(ids, [0] * 6 + [1] * 10)])
    tb = run_teacher(tiny_target, input_ids, valid, mask)
    starts = draft_starts(len(ids), 5, 4)
    logits, steps = eagle_logits(model, tb, starts)
    with torch.inference_mode():
        forced = model.parts.logits(model.forward_train(tb.hidden[-1], tb.input_ids)[0, tb.cols - 1])  # [M, V]
    first = steps == 1
    assert torch.allclose(logits[first], forced.expand_as(logits)[first], atol=1e-5)  # step 1: true features
    assert (logits[~first] - forced.expand_as(logits)[~first]).abs().max() > 1e-4  # later: its own
    for k in range(4):  # and a later step is what feeding its own predictions one at a time gives
        c = int(tb.cols[-1])
        root = int(starts[k, c])
        features = tb.hidden[-1].clone()
        with torch.inference_mode():
            for p in range(root, c):
                features[0, p] = model.forward_train(features, tb.input_ids)[0, p - 1]
            chained = model.parts.logits(model.forward_train(features, tb.input_ids)[0, c - 1])
        assert torch.allclose(logits[k, -1], chained, atol=1e-4)
