"""One model, one answer: under the defaults (``--dtype auto --weights auto``) plain decoding, every drafter, locally
and through a loopback server, give the same tokens — on a machine whose paths table would serve one token and a
tree fastest on different paths (an AVX2 Zen 3 once served plain decoding on int4 and every drafter and the server
on int8: 0 of 18 generations equal).

The paths table is injected, so the test asks the same question on any machine; the model is served as the
CLIs serve it, and the commands run in-process through ``shared.cli.main``.
"""

from __future__ import annotations

import argparse
import json

import pytest

from client.drafters.base import NoDrafter
from client.loop.decode import generate
from client.verifiers import LocalVerifier
from shared.cli import main
from shared.engine import kernels, paths
from shared.engine.models import load_target
from shared.engine.paths import SIZES, Table
from tests.conftest import served
from tests.test_paths import drafter_for

# one token fastest on int4 (int8 off the grid), trees on int8 / bf16: what decode and verify once chose apart
SPLIT = Table({p: dict(zip(SIZES, ms, strict=True)) for p, ms in {
    "int4": (7.0, 30.0, 90.0), "int8": (10.0, 15.0, 40.0), "bf16": (12.0, 13.0, 17.0), "fp32": (80.0, 120.0, 176.0),
}.items()}, "test CPU", "avx2", 2, "now")  # fmt: skip
PROMPT = "w5 w6 w7 w5 w6 w9 w5 w6 w7"
NEW = 24
TRAINED = ["eagle", "independent", "medusa", "moa-tli0", "moa-tli1"]


@pytest.fixture(params=["q4", "float"])
def model_dir(request, monkeypatch, q4_model_dir, tiny_model_dir):
    """A checkpoint on the Q4_1 grid (int4 serves its own values; int8 and bf16 would round them again) and one off
    it (int4 never; int8 or bf16), each under the split table."""
    if request.param == "q4" and not kernels.available():
        pytest.skip(f"the int4 path needs the kernels: {kernels.unavailable_reason()}")
    monkeypatch.setattr(paths, "table_for", lambda cfg, cache=None, refresh=False, own=None: SPLIT)
    if request.param == "q4":
        return str(q4_model_dir), ("float32", "int4")  # int4's mix is dearer, but the others round again
    return str(tiny_model_dir), ("bfloat16", "native")  # the cheapest mix; plain decoding alone would take int8


def cli(capsys, *args: str) -> dict:
    assert main(["generate", "--prompt", PROMPT, "--max-new-tokens", str(NEW), "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def cli_ids(capsys, *args: str) -> list[int]:
    return cli(capsys, *args)["token_ids"]


def test_every_drafter_and_the_server_give_plain_decodings_tokens(capsys, model_dir):
    model_dir, (dtype, weights) = model_dir
    local = {d: cli(capsys, "--local", "--model", model_dir, "--drafter", d)  # the model itself drafting: any path
             for d in ("none", "prompt-lookup", model_dir)}  # fmt: skip
    plain = local["none"]["token_ids"]
    assert len(plain) == NEW
    for drafter, out in local.items():
        assert out["served"] == {"dtype": dtype, "weights": weights}, drafter
        assert out["token_ids"] == plain, drafter

    target = load_target(model_dir, dtype="auto", weights="auto")  # as `serve` loads it
    assert (str(target.dtype).removeprefix("torch."), target.weights) == (dtype, weights), target.describe()
    for name in TRAINED:  # drafters of every kind, made ready for the target as a trained bundle is
        got = generate(LocalVerifier(target), drafter_for(name, target, model_dir), cli_prompt(target), NEW)
        assert got.token_ids == plain, name
    with served(target, max_sessions=8, max_tree_nodes=16, max_context=128, min_tree_nodes=16) as (address, _):
        remote = ["--server", address, "--model", model_dir]
        assert cli_ids(capsys, *remote, "--drafter", "prompt-lookup", "--mode", "draft") == plain
        assert cli_ids(capsys, *remote, "--drafter", "none") == plain
        assert cli_ids(capsys, *remote, "--baseline", "api") == plain
    assert generate(LocalVerifier(target), NoDrafter(), cli_prompt(target), NEW).token_ids == plain


def cli_prompt(target) -> list[int]:
    return target.tokenizer(PROMPT)["input_ids"]


def test_serve_and_generate_default_to_the_same_precision():
    """The server and the client parse the same defaults, so they load the model the same way."""
    from client.apps import cli as client_cli
    from server import cli as server_cli

    defaults = []
    for module in (server_cli, client_cli):
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        args = parser.parse_args([] if module is server_cli else ["--prompt", "x"])
        defaults.append((args.dtype, args.weights, args.device))
    assert defaults[0] == defaults[1] == ("auto", "auto", "cpu")
