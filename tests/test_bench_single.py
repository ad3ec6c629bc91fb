"""``bench.single``'s methods: what its flags make of a drafter's name."""

from __future__ import annotations

from bench.single import make_methods, parse_args


def test_a_model_drafter_runs_once_per_drafter_weights(tiny_target, tiny_model_dir):
    """``--drafter-weights int8,int4`` runs a model drafter once per path, as it does a trained drafter once per
    setting of its own layers: the one way to compare a model's drafting paths side by side."""
    name = str(tiny_model_dir)
    args = parse_args(["--model", name, "--drafters", name, "--drafter-weights", "int8,int4"])
    methods, skipped = make_methods([name], tiny_target, args)
    assert not skipped and [m.name for m in methods] == [f"{name}@int8", f"{name}@int4"]
    assert [m.drafter.lm.weights for m in methods] == ["int8", "int4"]
    one = make_methods([name], tiny_target, parse_args(["--model", name, "--drafters", name]))[0]
    assert [m.name for m in one] == [name]
