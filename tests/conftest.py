"""Shared fixtures: tiny random models built in the test, the real target, and in-process servers."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(2)

TINY_WORDS = [f"w{i}" for i in range(240)]
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def make_tiny_model_dir(path: Path, layers: int = 2, seed: int = 0, q4: bool = False) -> Path:
    """A real (tiny, random) Llama checkpoint with a real word-level tokenizer, saved as an HF folder; ``q4``: its
    blocks' projections on the Q4_1 grid, as a model dequantised from a 4-bit GGUF is (the built-in target)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {tok: i for i, tok in enumerate(specials + ["user", "assistant", "system"] + TINY_WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token="<|im_end|>", bos_token="<|im_start|>"
    )
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    config = LlamaConfig(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        eos_token_id=vocab["<|im_end|>"], bos_token_id=vocab["<|im_start|>"], tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # an untied, sharpened head: varied greedy paths, not a copy of the last token
        model.lm_head.weight.mul_(8.0)
        if q4:
            from shared.engine.quant import dequantize_int4, pack_int4

            for name, module in model.model.layers.named_modules():
                if name.endswith("_proj"):
                    module.weight.copy_(dequantize_int4(*pack_int4(module.weight)))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def q4_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama-q4"), q4=True)


@pytest.fixture(scope="session")
def tiny_target(tiny_model_dir):
    from shared.engine.models import load_target

    return load_target(str(tiny_model_dir))


@pytest.fixture(scope="session")
def real_target():
    """The real default target (SmolLM2-135M-Instruct), converted once into the user's cache."""
    from shared.engine.models import load_target

    return load_target("smollm2-135m")


def start_server(target, **limits):
    """An in-process gRPC server on a free loopback port; returns (server, address, service)."""
    from server.limits import ServerLimits
    from server.service import build_server

    server, port, service = build_server(target, "127.0.0.1", 0, ServerLimits(**limits))
    server.start()
    return server, f"127.0.0.1:{port}", service


@contextlib.contextmanager
def served(target, **limits):
    """``start_server`` for the length of a ``with``: yields (address, service), then stops the server."""
    server, address, service = start_server(target, **limits)
    try:
        yield address, service
    finally:
        server.stop(grace=None)


def own_server(tiny_target):
    """A module's own server of the tiny target, for tests that cut links or end sessions abruptly: a session whose
    close a cut swallowed stays until its TTL, so it allows many. A module takes it as a fixture of its own scope and
    name: ``server = pytest.fixture(scope="module", name="server")(own_server)``."""
    with served(tiny_target, max_sessions=64, max_tree_nodes=16, max_context=128, session_ttl_s=60.0) as running:
        yield running


def wait_until(condition, limit_s: float = 30.0) -> None:
    """A bounded wait for ``condition()`` (not a measurement: a slow machine only waits longer), then assert it."""
    deadline = time.monotonic() + limit_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert condition()


@pytest.fixture(scope="session")
def tiny_server(tiny_target):
    # min_tree_nodes = every node: the shared server never cuts a tree to what its budget learnt from earlier tests
    # (which would make a test's outcome depend on the ones before it and on the machine's load)
    with served(tiny_target, max_sessions=4, max_tree_nodes=16, max_context=128, min_tree_nodes=16) as running:
        yield running


@pytest.fixture(scope="session")
def netsim_server():
    """netsim's own Toxiproxy API in a child process, shared by every test that shapes a link."""
    from netsim import Netsim

    with Netsim.start_own() as sim:
        yield sim
