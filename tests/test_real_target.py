"""Integration on the real target: speculative greedy output equals transformers' own greedy generate."""

from __future__ import annotations

import pytest
import torch

from client.drafters import NoDrafter, PromptLookup
from client.loop.decode import Settings, generate
from client.net.api import api_complete
from client.net.remote import RemoteVerifier
from client.verifiers import LocalVerifier
from shared.engine.models import encode_prompt
from tests.conftest import start_server

pytestmark = pytest.mark.real

CODE = "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n"
PROMPTS = [
    ("Write a Python function that reverses a string.", True),
    ("What is the capital of France? Answer in one sentence.", True),
    (f"Add a docstring to this function and return the whole function:\n{CODE}", True),
    (f"Rename `fib` to `fibonacci` in this code:\n{CODE}", True),
    ("Explain what a hash table is to a child.", True),
    ("Write a SQL query that counts the rows of a table named users.", True),
    ("Give me a JSON object with keys name and age for a person called Ada, aged 36.", True),
    ("Write a bash loop that prints the numbers 1 to 5.", True),
    ("The history of the printing press", False),
    ("def is_even(n):\n    ", False),
    ("1, 2, 3, 4, 5, 6,", False),
    ("import numpy as np\n\n# compute the mean of a list\n", False),
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def references(real_target):
    """Greedy continuations from transformers' own generate()."""
    refs = []
    for text, chat in PROMPTS:
        ids = encode_prompt(real_target.tokenizer, text, chat)
        with torch.no_grad():
            out = real_target.reference_model().generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=real_target.eos_token_ids[0],
            )  # fmt: skip
        refs.append((ids, out[0, len(ids) :].tolist()))
    return refs


def drafter_for(i: int):
    """Vary the drafter across prompts: chains, small trees and no drafts at all."""
    return [PromptLookup(), PromptLookup(branches=3, num_tokens=6), NoDrafter()][i % 3]


def test_local_greedy_equals_transformers(real_target, references):
    mismatches = []
    for i, (ids, want) in enumerate(references):
        gen = generate(LocalVerifier(real_target), drafter_for(i), ids, NEW_TOKENS)
        if gen.token_ids != want:
            mismatches.append((PROMPTS[i][0][:40], gen.token_ids, want))
    assert not mismatches, mismatches


def test_grpc_greedy_equals_transformers(real_target, references):
    server, address, _ = start_server(real_target)
    try:
        remote = RemoteVerifier(address, fingerprint=real_target.fingerprint)
        mismatches = []
        for i, (ids, want) in list(enumerate(references))[::2]:  # half the prompts, every drafter: the local test
            gen = generate(remote, drafter_for(i + 1), ids, NEW_TOKENS)  # has them all, test_paths every path
            if gen.token_ids != want:
                mismatches.append((PROMPTS[i][0][:40], gen.token_ids, want))
        assert not mismatches, mismatches
        ids, want = references[0]
        assert api_complete(remote, ids, NEW_TOKENS).token_ids == want
        assert remote.counters.server_compute_s > 0
        remote.shutdown()
    finally:
        server.stop(grace=None)


@pytest.mark.parametrize("name", ["moa-tli0", "moa-tli1", "moa-tli3", "eagle", "independent"])
def test_shipped_trained_drafters_keep_greedy_output_exact(real_target, references, name):
    """Each shipped bundle, on the real target, in-process: the same tokens as transformers' greedy generate."""
    from client.drafters import make_drafter
    from client.drafters.bundle import find_bundle

    if find_bundle(name) is None:
        pytest.skip(f"no shipped bundle {name} (train one with `splitspec train`)")
    drafter = make_drafter(name, target=real_target)
    for i in (0, 2, 9):  # chat, code-editing and raw-code prompts
        ids, expected = references[i]
        gen = generate(LocalVerifier(real_target), drafter, ids, NEW_TOKENS, Settings(max_tree_nodes=16))
        assert gen.token_ids == expected[: len(gen.token_ids)], (name, i)
        assert gen.finish_reason == "stop" or len(gen.token_ids) == NEW_TOKENS


def test_split_moa_over_grpc_with_a_prefill_payload_beyond_4mb(real_target):
    """MoA TLI=1 with the target behind gRPC: a ~450-token prompt's all-layer KV is ~10 MB at fp16 (more
    than gRPC's 4 MB default), streamed by FetchPayload; kv and lsa payloads give the local greedy tokens,
    and lsa ships ~1.9 KB per newly cached token (memory 576 + TLI KV 384 values at fp16)."""
    from client.drafters import make_drafter

    text = "Continue this list of fruits, one per line:\n" + "\n".join(["apple", "banana", "cherry"] * 60)
    ids = encode_prompt(real_target.tokenizer, text, chat=True)
    assert len(ids) > 400
    want = generate(LocalVerifier(real_target), NoDrafter(), ids, 24).token_ids
    server, address, _ = start_server(real_target)
    try:
        for mode in ("kv", "lsa"):
            drafter = make_drafter("moa-tli1", target=real_target)
            spec = next(s for s in drafter.payload_specs(("fp16",)) if s.form == mode)
            remote = RemoteVerifier(address, drafter=drafter, spec=spec)
            gen = generate(remote, drafter, ids, 24, Settings(max_tree_nodes=16, spec=spec))
            remote.shutdown()
            assert gen.token_ids == want, mode
            assert gen.stats.server_calls >= gen.stats.rounds + 2  # open + FetchPayload for the prefill + rounds
            if mode == "kv":
                assert gen.stats.payload_bytes > 4 * 1024 * 1024
            else:
                cached = len(ids) + len(gen.token_ids) - 1
                assert gen.stats.payload_bytes / cached < 2.0 * 1024
    finally:
        server.stop(grace=None)


@pytest.fixture(scope="module")
def real_bf16():
    from shared.engine.models import load_target

    return load_target("smollm2-135m", dtype="bfloat16")


@pytest.fixture(scope="module")
def bf16_plain(real_bf16):
    """Plain bf16 decoding of the prompts the bf16 drafters are checked on, once for all of them."""
    return {i: generate(LocalVerifier(real_bf16), NoDrafter(), encode_prompt(real_bf16.tokenizer, *PROMPTS[i]),
                        48).token_ids for i in BF16_PROMPTS}  # fmt: skip


BF16_PROMPTS = (0, 2, 4, 9)


def test_real_target_engine_matches_transformers_on_a_tree(real_target):
    """fp32: the engine's logits of a tree after a prefix equal transformers' on each root-to-node path."""
    from shared.tree import DraftTree, path_to, tree_mask, tree_positions

    model, engine = real_target.reference_model(), real_target.engine
    prompt = encode_prompt(real_target.tokenizer, PROMPTS[0][0], True)
    tree = DraftTree([504, 28, 314, 2114, 30], [-1, -1, 0, 0, 2])
    session = real_target.session()
    session.prefill(prompt)
    n, root = session.cached_len, session.tokens[-1]
    with torch.no_grad():
        ids = torch.tensor([[root, *tree.tokens]])
        positions = torch.tensor([tree_positions(tree.parents, n)])
        hidden = engine(ids, positions, tree_mask(tree.parents, n), session.cache, n)
        got = engine.logits(hidden[0])
        for node in range(-1, len(tree)):
            path = [tree.tokens[i] for i in path_to(tree.parents, node)] if node >= 0 else []
            want = model(torch.tensor([prompt + [root] + path])).logits[0, -1]
            torch.testing.assert_close(got[node + 1], want, atol=2e-3, rtol=1e-3)


def bf16_is_cheap() -> bool:
    """Whether bf16 trees cost little here (native bf16 compute), by this machine's paths table for the target: in
    emulation (AVX2 only) a tree takes seconds and these tests minutes; the paths matrix covers bf16 everywhere."""
    from shared.engine.models import model_config, resolve_model
    from shared.engine.paths import table_for

    try:
        return table_for(model_config(resolve_model("smollm2-135m"))).ms.get("bf16", {}).get(17, 1e9) < 100
    except Exception:  # no target here: its tests skip anyway
        return False


@pytest.mark.skipif(not bf16_is_cheap(), reason="bf16 is emulated on this CPU (a 17-token forward over 100 ms): "
                    "minutes for these tests; bf16 exactness: test_paths.py, test_batching.py")
@pytest.mark.parametrize("name", ["moa-tli1", "eagle", "independent"])
def test_bf16_drafted_output_equals_bf16_plain_decoding(real_bf16, bf16_plain, name):
    """Served in bf16, every drafter gives exactly the bf16 plain decoding (no batch-shape rounding drift; trees of
    up to 32 nodes: two of the GEMMs' 16-row blocks)."""
    from client.drafters import make_drafter

    drafter = make_drafter(name, target=real_bf16)
    for i in BF16_PROMPTS:
        ids = encode_prompt(real_bf16.tokenizer, *PROMPTS[i])
        gen = generate(LocalVerifier(real_bf16), drafter, ids, 48, Settings(max_tree_nodes=32))
        assert gen.token_ids == bf16_plain[i], (name, i)


def test_adaptive_trees_follow_the_link_in_a_surviving_run(real_target, netsim_server):
    """The adaptive policy sizes trees by the link in a run that survives link drops (the default): over a
    150 ms round trip a round's RTT dwarfs what nodes cost to verify, so with the link it measured in the run it
    sends more of a tree than with loopback's, where the fp32 target's verification time grows with every node.
    (Judged on the same scored tree and the same server costs after each run: the rounds a run itself cuts are
    few and noisy, since it stops drafting while drafting loses, and so is a cost curve learned from them.)"""
    import math

    from client.drafters import make_drafter
    from client.loop.adaptive import AdaptivePolicy
    from client.loop.costs import CostCurve
    from netsim import simulated_link
    from netsim.profiles import Profile
    from shared.tree import DraftTree

    ids = encode_prompt(real_target.tokenizer, "Explain how the gears of a bicycle work.", chat=True)
    server, address, _ = start_server(real_target)
    probe = DraftTree.chain(list(range(100, 124)))  # 24 nodes, each 0.7 likely given its parent
    probe.scores = [(i + 1) * math.log(0.7) for i in range(24)]
    sizes, policies = {}, {}
    try:
        for profile in (Profile("loopback"), Profile("test-150ms", rtt_ms=150)):
            drafter = make_drafter("eagle", target=real_target)
            with simulated_link(address, profile, netsim=netsim_server) as link:
                verifier = RemoteVerifier(link.address, drafter=drafter)
                try:
                    verifier.connection.probe_link(budget_s=0.5)
                    # draft: on a fast served path auto may stream the whole run, and this is about drafted trees
                    policy = AdaptivePolicy.for_run(verifier, drafter.payload_specs(), mode="draft")
                    gen = generate(verifier, drafter, ids, 40, Settings(policy=policy))
                finally:
                    verifier.shutdown()
            assert gen.stats.heartbeat_probes > 0  # the link survival was on
            policies[profile.name] = policy
    finally:
        server.stop(grace=None)
    for name, policy in policies.items():  # the same server costs for both (fp32-like: 60 ms + 5 ms a node): only
        sizing = policy.sizing  # the link each run measured differs
        sizing.verify_fit, sizing.draft_step_s = CostCurve(), 0.0
        for n in range(1, 26):
            sizing.verify_fit.add(n, 0.060 + 0.005 * n)
        sizing.rounds, sizing.calibration = 10, 1.0  # past its explorations; the tree's scores as they are
        # and no drafting ahead measured: a loaded machine drafts ahead slower than loopback's wire, which adds the
        # same late drafting to every size, as a longer round trip would (the test failed so on an AMD Zen 4)
        sizing.ahead_s = None
        sizes[name] = policy.size(probe).nodes
    print(sizes)
    assert sizes["test-150ms"] > sizes["loopback"]


@pytest.fixture(scope="module")
def real_lowbit():
    from shared.engine import kernels
    from shared.engine.models import load_target

    if not kernels.available():
        pytest.skip(f"no CPU kernels: {kernels.unavailable_reason()}")
    return load_target("smollm2-135m", dtype="float32", weights="lowbit")  # int4: the GGUF's own values


def test_real_lowbit_tree_states_are_bit_identical_to_sequential_steps(real_lowbit):
    """The served int8 target (head size 64: the kernels' vector path): every node of a tree verified in one
    forward gets exactly the logits its path gets one token at a time."""
    from shared.tree import DraftTree, path_to, tree_mask, tree_positions

    engine = real_lowbit.engine
    prompt = encode_prompt(real_lowbit.tokenizer, PROMPTS[4][0], True)
    tree = DraftTree([504, 28, 314, 2114, 30, 12, 7, 9], [-1, -1, 0, 0, 2, 4, 1, -1])
    session = real_lowbit.session()
    session.prefill(prompt)
    n, root = session.cached_len, session.tokens[-1]
    with torch.no_grad():
        ids = torch.tensor([[root, *tree.tokens]])
        hidden = engine(ids, torch.tensor([tree_positions(tree.parents, n)]), tree_mask(tree.parents, n),
                        session.cache, n)[0]  # fmt: skip
        logits = engine.logits(hidden)
        for node in range(-1, len(tree)):
            path = [root] + [tree.tokens[i] for i in (path_to(tree.parents, node) if node >= 0 else [])]
            for j, token in enumerate(path):
                alone = engine(torch.tensor([[token]]), torch.tensor([[n + j]]), None, session.cache, n + j)[0, 0]
            assert torch.equal(engine.logits(alone[None])[0], logits[node + 1]), node


@pytest.mark.parametrize("name", ["prompt-lookup", "moa-tli1", "eagle", "independent"])
def test_lowbit_drafted_output_equals_its_plain_decoding(real_lowbit, name):
    """Served low-bit, every drafter (its own layers int8 too) gives exactly the target's own plain decoding."""
    assert real_lowbit.weights == "int4"
    from client.drafters import make_drafter

    drafter = make_drafter(name, target=real_lowbit)
    for i in (2, 9):
        ids = encode_prompt(real_lowbit.tokenizer, *PROMPTS[i])
        plain = generate(LocalVerifier(real_lowbit), NoDrafter(), ids, 48)
        gen = generate(LocalVerifier(real_lowbit), drafter, ids, 48, Settings(max_tree_nodes=32))
        assert gen.token_ids == plain.token_ids, (name, i)
