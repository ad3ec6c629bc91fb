"""One way to build a client (``client.build``): options that check themselves, a client that owns its parts."""

from __future__ import annotations

import pytest

from client.build import Client, ClientOptions, Shared
from client.drafters import make_drafter
from client.loop.decode import generate
from client.verifiers import LocalVerifier
from shared.errors import SplitspecError


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (dict(local=True, baseline="api"), "--baseline api needs a server"),
        (dict(local=True, via_netsim="4g"), "--via-netsim"),
        (dict(local=True, offline_drafter="none"), "--offline-drafter"),
        (dict(local=True, on_reconnect="keep"), "--on-reconnect"),
        (dict(on_reconnect="keep", keep_after_s=1.0), "--keep-after 1"),
        (dict(keep_after_s=-1.0), "--keep-after -1"),
        (dict(offline_cap=1.0), "--offline-cap 1"),
        (dict(static=True, mode="stream"), "--static"),
        (dict(mode="sometimes"), "mode 'sometimes'"),
        (dict(on_reconnect="retry"), "on_reconnect 'retry'"),
        (dict(max_tree_nodes=0), "--max-tree-nodes 0"),
    ],
)
def test_options_refuse_combinations_that_cannot_work_naming_them(options, named):
    with pytest.raises(SplitspecError, match=named):
        ClientOptions(**options)


def test_a_local_client_gives_plain_decodings_tokens_and_carries_its_policy(tiny_target):
    prompt = tiny_target.tokenizer("the cat sat on the")["input_ids"]
    plain = generate(LocalVerifier(tiny_target), make_drafter("none"), prompt, 24).token_ids
    shared = Shared(tiny_target, tiny_target.tokenizer)
    with Client(ClientOptions(local=True, drafter="prompt-lookup"), shared) as client:
        first = client.generate(prompt, 24)
        learnt = client.policy
        second = client.generate(prompt, 24)
        assert client.policy is not learnt and learnt is not None  # a new policy per run, started from the last
        client.forget()
        assert client.policy is None
    assert first.token_ids == plain and second.token_ids == plain


def test_a_static_client_verifies_whole_trees_with_no_policy(tiny_target):
    prompt = tiny_target.tokenizer("one two three one two three one two")["input_ids"]
    options = ClientOptions(local=True, static=True, drafter="prompt-lookup")
    with Client(options, Shared(tiny_target, tiny_target.tokenizer)) as client:
        gen = client.generate(prompt, 16)
        assert client.policy is None
    assert gen.token_ids == generate(LocalVerifier(tiny_target), make_drafter("none"), prompt, 16).token_ids


def test_a_remote_client_connects_once_and_again_after_disconnect(tiny_target, tiny_server):
    address, _ = tiny_server
    prompt = tiny_target.tokenizer("hello there")["input_ids"]
    shared = Shared(None, tiny_target.tokenizer, tiny_target.fingerprint)
    with Client(ClientOptions(server=address, drafter="none"), shared) as client:
        verifier = client.verifier
        assert client.verifier is verifier  # kept between generations
        a = client.generate(prompt, 8)
        client.disconnect()
        assert not client.connected
        b = client.generate(prompt, 8)
        assert client.verifier is not verifier
    api = Client(ClientOptions(server=address, baseline="api"), shared)
    with api:
        assert api.drafter is None
        c = api.generate(prompt, 8)
    assert a.token_ids == b.token_ids == c.token_ids


def test_a_pinned_payload_the_drafter_cannot_take_is_an_error_naming_both(tiny_target):
    options = ClientOptions(local=True, drafter="prompt-lookup", payload="kv")
    with Client(options, Shared(tiny_target, tiny_target.tokenizer)) as client, pytest.raises(
        SplitspecError, match="--payload kv: drafter prompt-lookup takes payload form none"
    ):
        client.generate([1, 2, 3], 4)


def test_a_model_drafter_is_loaded_beside_its_target_unless_told(monkeypatch):
    import types

    import torch

    import client.drafters as drafters

    where: list[str] = []

    def loaded(name: str, device: str, weights: str):
        where.append(device)
        raise LookupError(name)  # the place is all this test reads

    monkeypatch.setattr(drafters, "drafter_model", loaded)
    on_gpu = types.SimpleNamespace(device=torch.device("cuda", 0), tokenizer=None)
    for kwargs in (dict(target=on_gpu), dict(target=on_gpu, device="cpu"), {}):
        with pytest.raises(LookupError):
            make_drafter("qwen2.5-coder-0.5b", **kwargs)
    assert where == ["cuda:0", "cpu", "cpu"]


def test_a_model_drafter_on_cuda_drafts_on_graphs(monkeypatch):
    """A small model's step on a GPU is bound by launches (an inexact 1.5B forward on an H200: 20 ms eager, 5.8 ms on
    graphs), so a model drafter there loads with its forwards on CUDA graphs; on a CPU there are none."""
    import client.drafters as drafters
    import shared.engine.models as models

    asked: dict[str, bool] = {}
    monkeypatch.setattr(models, "load_target", lambda name, device, **kw: asked.setdefault(device, kw["graphs"]))
    for device in ("cuda", "cuda:1", "cpu"):
        drafters.drafter_model.__wrapped__("qwen2.5-coder-0.5b", device)
    assert asked == {"cuda": True, "cuda:1": True, "cpu": False}
