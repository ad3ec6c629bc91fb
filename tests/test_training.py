"""Training and bundles on a tiny random Llama: loss falls, resume is exact, bundles round-trip, strangers refused."""

from __future__ import annotations

import json
import random
from itertools import islice

import pytest
import torch
from safetensors.torch import load_file

from client.drafters import NoDrafter, drafter_for, make_drafter
from client.drafters.bundle import load_bundle, save_bundle
from client.loop.decode import Settings, generate
from client.training.datasets import TrainingStream
from client.training.trainer import TrainConfig, Trainer
from client.verifiers import LocalVerifier
from shared.cli import main as splitspec
from shared.errors import SplitspecError

DRAFTERS = [("moa", 0), ("moa", 1), ("eagle", 0), ("independent", 0), ("medusa", 0)]


def conversations(count: int = 40, seed: int = 0) -> list[list[dict]]:
    """Chats whose replies repeat patterns of their prompts, so there is something to learn."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        words = [f"w{rng.randrange(240)}" for _ in range(6)]
        reply = " ".join(words * 3)
        out.append([{"role": "user", "content": " ".join(words)}, {"role": "assistant", "content": reply}])
    return out


def stream(tokenizer, skip: int = 0) -> TrainingStream:
    return TrainingStream(tokenizer, 64, seed=0, skip=skip, conversations=conversations())


def make_trainer(target, tmp_path, tokens: int, drafters=DRAFTERS) -> Trainer:
    cfg = TrainConfig(list(drafters), tokens, tmp_path, seq_len=64, batch_size=2, lr=2e-3, warmup_tokens=50)
    return Trainer(target, cfg)


def test_training_lowers_every_drafters_loss(tiny_target, tmp_path):
    trainer = make_trainer(tiny_target, tmp_path, 10_000)
    batch = [next(stream(tiny_target.tokenizer)) for _ in range(2)]
    trainer.seen = 10**9  # past warm-up: a constant (minimum) learning rate for this test
    trainer.cfg.min_lr_ratio = 1.0
    first = trainer.step(batch)
    for _ in range(15):
        last = trainer.step(batch)
    for name in first:
        assert last[name]["loss"] < 0.7 * first[name]["loss"], (name, first[name], last[name])


def test_a_served_low_bit_teacher_teaches_as_the_float_model_does(q4_model_dir, tmp_path):
    """The target as served (int4 on the kernels: the checkpoint's own 4-bit values) as the teacher, its frozen parts
    from the float model: the teacher's features and logits match the float model's to the kernels' int8 activations,
    and every drafter, TLI through the float layers included, learns from it."""
    from client.training.teacher import pad_batch, run_teacher
    from shared.engine import kernels
    from shared.engine.models import load_target

    if not kernels.available():
        pytest.skip(f"the low-bit teacher needs the kernels: {kernels.unavailable_reason()}")
    native = load_target(str(q4_model_dir), dtype="float32", weights="native")
    # the low-bit path pinned: ``auto`` times the paths, and on a tiny model fp32 may win (an AMD Zen 4 picked it)
    served = load_target(str(q4_model_dir), weights="lowbit")
    assert served.weights == "int4"
    batch = [next(stream(native.tokenizer)) for _ in range(2)]
    vocab = torch.arange(0, 200)
    low, ref = (run_teacher(t, *pad_batch(batch), vocab_ids=vocab) for t in (served, native))
    assert low.keys.dtype == ref.keys.dtype == torch.float32 and low.teacher_logits.shape == ref.teacher_logits.shape
    assert torch.allclose(low.hidden[-1], ref.hidden[-1], atol=0.1, rtol=0.05)
    agree = (low.teacher_logits.argmax(-1) == ref.teacher_logits.argmax(-1)).float().mean()
    assert agree > 0.9, agree
    cfg = TrainConfig(list(DRAFTERS[:3]), 10_000, tmp_path, seq_len=64, batch_size=2, lr=2e-3, warmup_tokens=50)
    trainer = Trainer(native, cfg, vocab, teacher=served)
    trainer.seen, trainer.cfg.min_lr_ratio = 10**9, 1.0
    first = trainer.step(batch)
    for _ in range(15):
        last = trainer.step(batch)
    for name in first:
        assert last[name]["loss"] < 0.7 * first[name]["loss"], (name, first[name], last[name])
    assert "int4" in trainer.budget()["teacher"]


def test_resume_continues_exactly(tiny_target, tmp_path):
    whole = make_trainer(tiny_target, tmp_path / "whole", 600, drafters=[("moa", 1), ("eagle", 0)])
    whole.run(stream(tiny_target.tokenizer), progress=False)

    half = make_trainer(tiny_target, tmp_path / "split", 600, drafters=[("moa", 1), ("eagle", 0)])
    half.run(stream(tiny_target.tokenizer), progress=False, until_tokens=300)
    assert 300 <= half.seen < 600
    resumed = make_trainer(tiny_target, tmp_path / "split", 600, drafters=[("moa", 1), ("eagle", 0)])
    assert resumed.resume() and resumed.steps == half.steps and resumed.position == half.position
    resumed.run(stream(tiny_target.tokenizer, skip=resumed.position), progress=False)

    assert resumed.steps == whole.steps and resumed.seen == whole.seen
    for name, model in whole.models.items():
        for key, value in model.trainable_state().items():
            assert torch.allclose(value, resumed.models[name].trainable_state()[key], atol=1e-6), (name, key)


def test_a_narrow_drafter_is_smaller_and_its_bundle_says_so(tiny_target, tmp_path):
    """``mlp_hidden``: the drafters' MLP narrower than the target's (a 1.5B's would make bundles of hundreds of MB);
    the bundle carries the width, so it loads and drafts as trained."""
    drafters = [("moa", 1), ("eagle", 0), ("independent", 0)]
    wide = make_trainer(tiny_target, tmp_path / "wide", 100, drafters=drafters)
    cfg = TrainConfig(drafters, 100, tmp_path / "narrow", seq_len=64, batch_size=2, lr=2e-3, warmup_tokens=50,
                      mlp_hidden=32)  # fmt: skip
    narrow = Trainer(tiny_target, cfg)
    narrow.run(stream(tiny_target.tokenizer), progress=False)
    for name, model in narrow.models.items():
        count = lambda m: sum(p.numel() for p in m.parameters() if p.requires_grad)  # noqa: E731
        assert count(model) < count(wide.models[name]) and model.cfg.mlp_hidden == 32, name
        loaded, config = load_bundle(tmp_path / "narrow" / name, tiny_target)
        assert config["model"]["mlp_hidden"] == 32 and count(loaded) == count(model)


def test_a_checkpoint_refuses_other_drafters(tiny_target, tmp_path):
    make_trainer(tiny_target, tmp_path, 100, drafters=[("eagle", 0)]).run(stream(tiny_target.tokenizer), progress=False)
    other = make_trainer(tiny_target, tmp_path, 200, drafters=[("moa", 0)])
    with pytest.raises(SplitspecError, match="resume with the same"):
        other.resume()


@pytest.mark.parametrize(("kind", "tli"), DRAFTERS)
def test_bundle_round_trip_gives_the_same_drafts(tiny_target, tmp_path, kind, tli):
    trainer = make_trainer(tiny_target, tmp_path, 200, drafters=[(kind, tli)])
    trainer.run(stream(tiny_target.tokenizer), progress=False)
    name = next(iter(trainer.models))
    path = save_bundle(trainer.models[name], tmp_path / "b", tiny_target, trainer.budget(), dtype="float32")
    config = json.loads((path / "config.json").read_text())
    assert config["training"]["tokens"] == trainer.seen and config["kind"] == kind and config["tli"] == tli
    assert not any(k.startswith("parts.") for k in load_file(str(path / "weights.safetensors")))
    prompt = [5, 9, 14, 5, 9, 21, 33, 5, 9]
    plain = generate(LocalVerifier(tiny_target), NoDrafter(), prompt, 24)
    drafts = []
    for model in (trainer.models[name], load_bundle(path, tiny_target)[0]):
        drafter = drafter_for(model.eval(), name)
        gen = generate(LocalVerifier(tiny_target), drafter, prompt, 24, Settings(max_tree_nodes=8))
        assert gen.token_ids == plain.token_ids  # lossless whatever the drafter
        drafter.begin(prompt, tiny_target.session(feature_kinds=drafter.feature_kinds).prefill(prompt[:-1]).features)
        tree = drafter.propose(8)
        drafts.append((tree.tokens, tree.parents))
    assert drafts[0] == drafts[1]


def test_bundles_for_another_target_are_refused(tiny_target, tmp_path):
    trainer = make_trainer(tiny_target, tmp_path, 100, drafters=[("moa", 0)])
    trainer.run(stream(tiny_target.tokenizer), progress=False)
    path = tmp_path / "moa-tli0"
    config = json.loads((path / "config.json").read_text())
    config["target"]["tokenizer_fingerprint"] = "0123456789abcdef"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SplitspecError, match="tokenizer 0123456789abcdef"):
        load_bundle(path, tiny_target)
    with pytest.raises(SplitspecError, match="unknown drafter"):
        make_drafter(str(tmp_path / "nowhere"), target=tiny_target)


def test_a_name_picks_the_bundle_trained_for_the_target(tiny_target, tmp_path):
    """Bundles of one name for several targets live in the targets' folders (``bundles/<target>/moa-tli0``): the name
    finds the one whose tokenizer is the target's; with none for it, the error names the target it was trained for."""
    import shutil

    from shared.bundles import find_bundle

    trainer = make_trainer(tiny_target, tmp_path / "run", 100, drafters=[("moa", 0)])
    trainer.run(stream(tiny_target.tokenizer), progress=False)
    shelf = tmp_path / "bundles"
    for folder, fingerprint in (("another-model", "0123456789abcdef"), ("tiny", tiny_target.fingerprint)):
        shutil.copytree(tmp_path / "run" / "moa-tli0", shelf / folder / "moa-tli0")
        config = json.loads((shelf / folder / "moa-tli0" / "config.json").read_text())
        config["target"]["tokenizer_fingerprint"], config["target"]["name"] = fingerprint, folder
        (shelf / folder / "moa-tli0" / "config.json").write_text(json.dumps(config))
    assert find_bundle("moa-tli0", (shelf,), tiny_target.fingerprint) == shelf / "tiny" / "moa-tli0"
    assert find_bundle("moa-tli0", (shelf,)) == shelf / "another-model" / "moa-tli0"  # (sorted; no target named)
    shutil.rmtree(shelf / "tiny")
    only = find_bundle("moa-tli0", (shelf,), tiny_target.fingerprint)
    with pytest.raises(SplitspecError, match="trained for target 'another-model'"):
        load_bundle(only, tiny_target)
    assert find_bundle("moa-tli9", (shelf,), tiny_target.fingerprint) is None


def test_generate_local_with_a_bundle_path(tiny_target, tiny_model_dir, tmp_path, capsys):
    trainer = make_trainer(tiny_target, tmp_path, 100, drafters=[("moa", 1)])
    trainer.run(stream(tiny_target.tokenizer), progress=False)
    argv = ["generate", "--local", "--model", str(tiny_model_dir), "--prompt", "w1 w2 w3 w1 w2", "--json"]
    assert splitspec([*argv, "--drafter", str(tmp_path / "moa-tli1"), "--max-new-tokens", "12"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["drafter"] == "moa-tli1" and out["stats"]["new_tokens"] == 12


def test_warm_start_from_bundles_alone(tiny_target, tmp_path):
    """Checkpoints are too big for git: bundles alone bring back the weights and the progress."""
    first = make_trainer(tiny_target, tmp_path, 600, drafters=[("moa", 0), ("independent", 0)])
    first.run(stream(tiny_target.tokenizer), progress=False, until_tokens=300)
    (tmp_path / "checkpoint.pt").unlink()
    again = make_trainer(tiny_target, tmp_path, 600, drafters=[("moa", 0), ("independent", 0)])
    assert again.resume()
    assert (again.seen, again.steps, again.position) == (first.seen, first.steps, first.position)
    from client.training.trainer import REWARM_TOKENS, lr_at

    assert again.lr() < 0.01 * lr_at(again.cfg, again.seen)  # fresh moments: the rate ramps up again
    again.seen += REWARM_TOKENS
    assert again.lr() == lr_at(again.cfg, again.seen)
    again.seen -= REWARM_TOKENS
    assert first.rewarm_from is None  # a run from scratch (or a checkpoint) keeps the schedule's own warm-up
    for name, model in first.models.items():
        for key, value in model.trainable_state().items():
            assert torch.allclose(value, again.models[name].trainable_state()[key], atol=2e-3, rtol=1e-3), key
    assert not make_trainer(tiny_target, tmp_path / "empty", 600, drafters=[("eagle", 0)]).resume()
    elsewhere = make_trainer(tiny_target, tmp_path, 600, drafters=[("moa", 0), ("independent", 0)])
    elsewhere.cfg.data = "other sequences"  # continued on other data: the stream starts afresh, the bundle says both
    assert elsewhere.resume() and elsewhere.position == 0
    assert elsewhere.budget()["data"] == f"{first.seen} tokens of {first.cfg.data}, then other sequences"


def test_shards_give_back_the_stream_in_order_and_resume(tiny_target, tmp_path, monkeypatch):
    from client.training import shards

    monkeypatch.setattr(shards, "PER_SHARD", 3)  # several shard files for 8 sequences
    want = [next(s) for s in [stream(tiny_target.tokenizer)] for _ in range(8)]
    meta = shards.write_shards(stream(tiny_target.tokenizer), tmp_path, sequences=8, progress=False,
                               about={"seq_len": 64})  # fmt: skip
    assert meta["sequences"] == 8 and len(meta["files"]) == 3 and meta["seq_len"] == 64
    assert meta["tokens"] == sum(len(ids) for ids, _ in want)
    got = shards.ShardStream(tmp_path)
    assert [next(got) for _ in range(8)] == [(ids, mask + [0] * (len(ids) - len(mask))) for ids, mask in want]
    assert next(got) == next(shards.ShardStream(tmp_path))  # cycles
    assert next(shards.ShardStream(tmp_path, skip=5))[0] == want[5][0]
    with pytest.raises(SplitspecError, match="no training shards"):
        shards.ShardStream(tmp_path / "nothing")


def test_draft_segments_cut_every_6_to_14_tokens_with_a_random_phase():
    from client.training.losses import SEGMENT, draft_segments

    generator = torch.Generator().manual_seed(0)
    firsts = set()
    for length in (1, 7, 64, 301):
        starts = draft_segments(4, length, generator)
        assert starts.shape == (4, length)
        for row in starts.tolist():
            assert row[0] == 0 and all(s <= t for t, s in enumerate(row))
            bounds = [t for t in range(1, length) if row[t] != row[t - 1]]
            assert all(row[t] == t for t in bounds)  # a new draft starts where its positions begin
            sizes = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
            assert all(SEGMENT[0] <= n < SEGMENT[1] for n in sizes), sizes
            firsts.add(bounds[0] if bounds else length)
    assert len(firsts) > 3  # the first cut falls at varied places


def test_long_drafts_cut_a_share_of_sequences_every_32_to_64_tokens():
    from client.training.losses import LONG_SEGMENT, SEGMENT, draft_segments

    generator = torch.Generator().manual_seed(1)
    starts = draft_segments(400, 300, generator, long_share=0.25)
    longest = []
    for row in starts.tolist():
        bounds = [t for t in range(1, 300) if row[t] != row[t - 1]]
        sizes = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
        assert all(SEGMENT[0] <= n < SEGMENT[1] for n in sizes) or all(LONG_SEGMENT[0] <= n < LONG_SEGMENT[1]
                                                                        for n in sizes), sizes  # fmt: skip
        longest.append(max(sizes) >= LONG_SEGMENT[0])
    assert 0.15 < sum(longest) / len(longest) < 0.35  # about a quarter of the sequences
    short = draft_segments(400, 300, torch.Generator().manual_seed(1))
    assert torch.equal(short, draft_segments(400, 300, torch.Generator().manual_seed(1), long_share=0.0))


def test_eagle_on_policy_pass_feeds_its_own_features(tiny_target, tmp_path):
    """--on-policy mixes in a pass on the drafter's own predicted features: it reports that pass's agreement and
    changes the gradient (0 keeps plain teacher forcing)."""
    from client.training.losses import loss
    from client.training.teacher import pad_batch, run_teacher

    trainer = make_trainer(tiny_target, tmp_path, 1000, drafters=[("eagle", 0)])
    model = trainer.models["eagle"]
    tb = run_teacher(tiny_target, *pad_batch([next(stream(tiny_target.tokenizer)) for _ in range(2)]))
    grads = []
    for weight in (0.0, 0.5):
        model.zero_grad()
        value, metrics = loss(model, tb, torch.Generator().manual_seed(0), on_policy=weight)
        value.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
        assert ("acc_own" in metrics) == (weight > 0)
    assert not torch.allclose(grads[0], grads[1])


def test_a_warm_start_keeps_the_bundles_draft_vocabulary(tiny_target, tmp_path):
    from client.training.trainer import bundle_vocab

    vocab = torch.arange(0, 200, 2)
    cfg = TrainConfig([("eagle", 0)], 200, tmp_path, seq_len=64, batch_size=2)
    Trainer(tiny_target, cfg, vocab).save()
    assert torch.equal(bundle_vocab(tmp_path, [("eagle", 0)]), vocab)
    assert bundle_vocab(tmp_path, [("eagle", 0), ("moa", 1)]) is None  # not every drafter has a bundle there
    Trainer(tiny_target, TrainConfig([("moa", 0)], 200, tmp_path / "full", seq_len=64)).save()
    assert bundle_vocab(tmp_path / "full", [("moa", 0)]) is None  # the full vocabulary


def test_the_staircase_curriculum_falls_from_one_to_none_by_half_the_budget(tiny_target, tmp_path):
    trainer = make_trainer(tiny_target, tmp_path, 1000, drafters=[("moa", 0)])
    assert trainer.staircase() == 0.0  # off unless asked
    trainer.cfg.staircase = True
    probabilities = []
    for seen in (0, 250, 500, 900):
        trainer.seen = seen
        probabilities.append(trainer.staircase())
    assert probabilities == [1.0, 0.5, 0.0, 0.0]
    trainer.seen = 0
    trainer.step([next(stream(tiny_target.tokenizer)) for _ in range(2)])  # a step with the mask trains


def test_a_bundle_loads_with_another_draft_vocabulary(tiny_target, tmp_path):
    vocab = torch.arange(0, 200, 2)
    cfg = TrainConfig([("eagle", 0)], 200, tmp_path, seq_len=64, batch_size=2)
    Trainer(tiny_target, cfg, vocab).save()
    prompt = [5, 9, 14, 5, 9, 21, 33, 5, 9]
    plain = generate(LocalVerifier(tiny_target), NoDrafter(), prompt, 16)
    odd = torch.arange(1, 120, 2)
    full = torch.empty(0, dtype=torch.long)
    for ids, allowed in ((None, set(vocab.tolist())), (odd, set(odd.tolist())), (full, None)):
        model, _ = load_bundle(tmp_path / "eagle", tiny_target, vocab_ids=ids)
        expected = len(vocab) if ids is None else len(ids) or tiny_target.vocab_size
        assert model.parts.logits(torch.zeros(1, model.cfg.hidden_size)).shape[-1] == expected
        drafter = drafter_for(model, "eagle")
        gen = generate(LocalVerifier(tiny_target), drafter, prompt, 16, Settings(max_tree_nodes=8))
        assert gen.token_ids == plain.token_ids
        drafter.begin(prompt, tiny_target.session(feature_kinds=drafter.feature_kinds).prefill(prompt[:-1]).features)
        tokens = drafter.propose(8).tokens
        assert tokens and (allowed is None or set(tokens) <= allowed)


def test_self_distilled_answers_are_the_targets_own(tiny_target):
    """Each sequence is a training prompt's opening turn and the target's greedy answer, batched or not."""
    from client.training.datasets import encode_chat
    from client.training.self_distill import SelfDistillStream, opening
    from shared.tree import DraftTree

    chats = conversations()
    stream = SelfDistillStream(tiny_target, 48, batch=3, conversations=chats)
    order = TrainingStream(tiny_target.tokenizer, 48, conversations=chats)
    prompts = [encode_chat(tiny_target.tokenizer, opening(order.conversation_at(i)), answer_prompt=True)[0]
               for i in range(len(chats))]  # fmt: skip
    stop = set(tiny_target.eos_token_ids)
    for _ in range(4):
        ids, mask = stream.__next__()
        prompt = next(p for p in prompts if ids[: len(p)] == p and mask[: len(p)] == [0] * len(p))
        assert mask == [0] * len(prompt) + [1] * (len(ids) - len(prompt))
        alone = tiny_target.session()
        alone.prefill(prompt)
        while alone.tokens[-1] not in stop and len(alone.tokens) < 48:
            alone.verify(DraftTree())
        assert ids == alone.tokens
    assert stream.position > 0 and stream.generated >= 4


def test_interrupted_shards_continue_where_they_stopped(tiny_target, tmp_path):
    from client.training import shards

    whole = shards.write_shards(stream(tiny_target.tokenizer), tmp_path / "whole", sequences=7, progress=False,
                                per_shard=2)  # fmt: skip
    first = shards.write_shards(stream(tiny_target.tokenizer), tmp_path / "split", sequences=4, progress=False,
                                per_shard=2)  # fmt: skip
    assert first["complete"] and first["position"] > 0
    rest = shards.write_shards(stream(tiny_target.tokenizer, skip=first["position"]), tmp_path / "split",
                               sequences=7, progress=False, per_shard=2, resume=True)  # fmt: skip
    assert rest["sequences"] == 7 and rest["tokens"] == whole["tokens"] and len(rest["files"]) == 4
    a, b = shards.ShardStream(tmp_path / "whole"), shards.ShardStream(tmp_path / "split")
    assert [next(a) for _ in range(7)] == [next(b) for _ in range(7)]


def test_self_distillation_needs_a_shards_folder(tmp_path, capsys):
    code = splitspec(["train", "--drafter", "medusa", "--self-distill", "--tokens", "10", "--out", str(tmp_path)])
    assert code != 0 and "--shards" in capsys.readouterr().err


def test_int8_bundles_are_half_the_bytes_and_draft_losslessly(tiny_target, tmp_path):
    """``bundle_dtype="int8"``: each matrix rounded per row (a 1.5B's MoA fits 40 MB only so); the weights come back
    within half a rounding step, warm start and the server's LSA read them, and the drafter stays lossless. A zero
    sitting only writes the bundles again (how a trained run is packed for shipping); history keeps a curve."""
    from shared.bundles import SCALE, read_weights
    from shared.lsa import load_lsa

    drafters = [("moa", 1), ("eagle", 0)]
    first = make_trainer(tiny_target, tmp_path, 200, drafters=drafters)
    first.cfg.history = True
    first.run(stream(tiny_target.tokenizer), progress=False)
    sizes16 = {n: (tmp_path / n / "weights.safetensors").stat().st_size for n in first.models}
    assert sorted(p.name for p in (tmp_path / "history").iterdir()) == [f"{first.seen:09d}"]
    packed = make_trainer(tiny_target, tmp_path, 200, drafters=drafters)
    packed.cfg.bundle_dtype = "int8"
    assert packed.resume()
    packed.run(stream(tiny_target.tokenizer), progress=False, time_limit_s=0)
    assert packed.steps == first.steps
    prompt = [5, 9, 14, 5, 9, 21, 33, 5, 9]
    plain = generate(LocalVerifier(tiny_target), NoDrafter(), prompt, 24)
    for name, model in first.models.items():
        path = tmp_path / name
        assert json.loads((path / "config.json").read_text())["weights_dtype"] == "int8"
        assert (path / "weights.safetensors").stat().st_size < 0.65 * sizes16[name], name
        stored = load_file(str(path / "weights.safetensors"))
        weights = read_weights(path)
        assert not any(k.endswith(SCALE) for k in weights)
        for key, value in model.trainable_state().items():
            step = stored[key + SCALE].float()[:, None] if key + SCALE in stored else None
            if step is not None:
                assert stored[key].dtype == torch.int8
                assert ((weights[key] - value.float()).abs() <= 0.51 * step + 1e-7).all(), key
        loaded = load_bundle(path, tiny_target)[0]
        assert generate(
            LocalVerifier(tiny_target), drafter_for(loaded, name), prompt, 24,
            Settings(max_tree_nodes=8),
        ).token_ids == plain.token_ids  # fmt: skip
    lsa, _ = load_lsa(tmp_path / "moa-tli1", tiny_target)
    assert torch.equal(lsa.lsa_in.weight.float(), read_weights(tmp_path / "moa-tli1")["lsa_in.weight"])
    (tmp_path / "checkpoint.pt").unlink()
    assert make_trainer(tiny_target, tmp_path, 200, drafters=drafters).resume()  # warm start from int8 bundles


def test_a_bundle_says_how_it_was_made_and_its_curve(tiny_target, tmp_path):
    """Each sitting's command and the drafters' loss between checkpoints go into the bundle, across a warm start."""
    first = make_trainer(tiny_target, tmp_path, 400, drafters=[("eagle", 0)])
    first.cfg.checkpoint_every_s = 0.0  # a checkpoint after every step: a point of the curve each
    first.run(stream(tiny_target.tokenizer), progress=False, until_tokens=200)
    (tmp_path / "checkpoint.pt").unlink()
    again = make_trainer(tiny_target, tmp_path, 400, drafters=[("eagle", 0)])
    again.cfg.checkpoint_every_s = 0.0
    assert again.resume()
    again.run(stream(tiny_target.tokenizer, skip=again.position), progress=False)
    training = json.loads((tmp_path / "eagle" / "config.json").read_text())["training"]
    assert [s["from_tokens"] for s in training["sittings"]] == [0, first.seen]
    assert all("pytest" in s["command"] or "python" in s["command"] for s in training["sittings"])
    curve = training["curve"]
    assert len(curve) >= again.steps - 1 and curve[-1]["tokens"] == again.seen
    assert [c["tokens"] for c in curve] == sorted(c["tokens"] for c in curve)
    assert curve[-1]["loss"] < curve[0]["loss"]


def test_a_signal_ends_a_sitting_with_a_checkpoint(tiny_target, tmp_path):
    """SIGTERM (the session ending, `kill`) or SIGINT (also where a background job ignores it) ends a sitting as its
    time limit does: checkpoint and bundles written, nothing of the steps done lost."""
    import os
    import signal

    from client.training.cli import stop_on_signals

    trainer = make_trainer(tiny_target, tmp_path, 100_000, drafters=[("eagle", 0)])
    done, real_step = [], trainer.step

    def step(batch):
        out = real_step(batch)
        done.append(1)
        if len(done) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    trainer.step = step
    old = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        stop_on_signals()
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            trainer.run(stream(tiny_target.tokenizer), progress=False)
    finally:
        signal.signal(signal.SIGTERM, old[0])
        signal.signal(signal.SIGINT, old[1])
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    bundle = json.loads((tmp_path / "eagle" / "config.json").read_text())
    assert state["steps"] == 2 and bundle["training"]["steps"] == 2


def test_a_sitting_fitted_to_its_time_anneals_before_the_limit(tiny_target, tmp_path):
    """--fit-time: with each step costing 10 s on an injected clock, the budget shrinks to what the measured rate
    reaches in the 200 s sitting, so the run ends at the schedule's floor instead of being cut off at its peak."""

    def run(fit: bool) -> Trainer:
        trainer = make_trainer(tiny_target, tmp_path / str(fit), 100_000, drafters=[("eagle", 0)])
        trainer.run(stream(tiny_target.tokenizer), progress=False, time_limit_s=200, fit=fit,
                    clock=lambda: 10.0 * trainer.steps)  # fmt: skip
        return trainer

    fitted, cut = run(True), run(False)
    assert cut.cfg.tokens == 100_000 and cut.lr() > 0.9 * cut.cfg.lr  # stopped by the clock, mid-schedule
    per_step = fitted.seen / fitted.steps
    assert fitted.seen < 100_000 and fitted.cfg.tokens <= fitted.seen < fitted.cfg.tokens + per_step
    assert fitted.steps <= 20  # done within the sitting's 200 s
    assert fitted.cfg.tokens > 0.8 * 20 * per_step  # and it used most of it
    assert fitted.lr() == pytest.approx(fitted.cfg.lr * fitted.cfg.min_lr_ratio)


def test_fit_time_needs_a_time_limit(tmp_path, capsys):
    assert splitspec(["train", "--drafter", "eagle", "--tokens", "100", "--out", str(tmp_path), "--fit-time"]) != 0
    assert "--time-limit" in capsys.readouterr().err


def test_the_draft_vocabulary_counts_the_shards_where_they_are_given(tiny_target, tmp_path):
    """A GPU machine trains from shards without the dataset package: its vocabulary is counted over them."""
    from client.training.shards import ShardStream, write_shards
    from client.training.vocab import draft_vocab

    write_shards(stream(tiny_target.tokenizer), tmp_path, sequences=30, progress=False, about={"seq_len": 64})
    said = {t for ids, mask in islice(stream(tiny_target.tokenizer), 30) for t, m in zip(ids, mask, strict=True) if m}
    ids, coverage = draft_vocab(tiny_target.tokenizer, 10_000, sample=30, stream=ShardStream(tmp_path))
    assert set(ids.tolist()) == said | set(tiny_target.tokenizer.all_special_ids) and coverage == 1.0
    small, part = draft_vocab(tiny_target.tokenizer, 40, sample=30, stream=ShardStream(tmp_path))
    assert len(small) == 40 and set(small.tolist()) < set(ids.tolist()) and part < 1.0
