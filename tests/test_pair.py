"""The realistic pair, opt-in (`make test-pair`, after `make pair`): Qwen2.5-Coder-1.5B served from its GGUF, its
0.5B sibling drafting. Kept out of `make test` (marker ``pair``): the suite's budget has no room for a 1.5B model,
and a fresh machine has not downloaded it. The benchmarks (`make bench-pair*`) measure the pair; these tests check
that what they measure is right: the file's own values served, every output lossless, the tokenizer check."""

from __future__ import annotations

import pytest

from client.drafters import NoDrafter, make_drafter
from client.loop.decode import generate
from client.net.remote import RemoteVerifier
from client.verifiers import LocalVerifier
from shared.engine.files import cache_dir
from shared.engine.linear import Linear
from shared.engine.models import encode_prompt, load_target
from shared.engine.pull import gguf_path
from shared.errors import SplitspecError
from tests.conftest import served

pytestmark = pytest.mark.pair

TARGET, DRAFTER = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
PROMPT = (
    "Complete this Python function.\n\n"
    "def has_close_elements(numbers: list[float], threshold: float) -> bool:\n"
    '    """Check if in the given list of numbers, any two numbers are closer to each other than threshold."""\n'
)
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def pair():
    """The 1.5B as `splitspec serve` loads it by default (``auto``: the one path served here, the file's own values),
    the prompt, and its plain greedy decoding: what every other way of generating must give."""
    try:
        for name in (TARGET, DRAFTER):
            gguf_path(name, cache_dir())
    except SplitspecError as exc:
        pytest.skip(str(exc))
    target = load_target(TARGET, dtype="auto")
    ids = encode_prompt(target.tokenizer, PROMPT, chat=True)
    plain = generate(LocalVerifier(target), NoDrafter(), ids, NEW_TOKENS)
    assert len(plain.token_ids) == NEW_TOKENS
    return target, ids, plain.token_ids


def test_every_projection_is_served_at_the_files_values(pair):
    """Q4_K_M stores every projection as Q4_K or Q6_K blocks: none may be re-quantised to int8 (a second rounding)."""
    target, _, _ = pair
    kinds = {}
    for name, module in target.engine.named_modules():
        if isinstance(module, Linear) and not name.endswith(".tail"):
            kinds[name] = {module.weights_kind()} | ({module.tail.weights_kind()} if module.tail is not None else set())
    rounded_again = {name: kind for name, kind in kinds.items() if not kind <= {"int4", "int6"}}
    assert kinds and not rounded_again, rounded_again


@pytest.mark.parametrize("drafter", [DRAFTER, f"{DRAFTER}+lookup"])
def test_the_sibling_drafts_most_of_the_answer_and_changes_no_token(pair, drafter):
    target, ids, plain = pair
    gen = generate(LocalVerifier(target), make_drafter(drafter, target=target), ids, NEW_TOKENS)
    assert gen.token_ids == plain
    assert gen.stats.acceptance_length > 2.0, gen.stats.acceptance_length  # 82-91 % of its drafts are taken on code


def test_split_over_loopback_gives_the_plain_tokens(pair):
    target, ids, plain = pair
    drafter = make_drafter(DRAFTER, target=target)
    with served(target, max_sessions=2) as (address, _):
        remote = RemoteVerifier(address, fingerprint=target.fingerprint, drafter=drafter)
        try:
            gen = generate(remote, drafter, ids, NEW_TOKENS)
        finally:
            remote.shutdown()
    assert gen.token_ids == plain
    assert gen.stats.server_calls >= 2


def test_a_drafter_with_another_tokenizer_is_refused(pair):
    target, _, _ = pair
    with pytest.raises(SplitspecError, match="has another tokenizer than the target's"):
        make_drafter("smollm2-135m", target=target)


OWN = ["moa-tli0", "moa-tli1", "eagle"]  # drafters trained for the 1.5B (client/drafters/bundles/qwen2.5-coder-1.5b)


def own_drafter(target, name: str):
    """The shipped bundle of ``name`` trained for the 1.5B, as ``--drafter NAME`` finds it; skips where none is."""
    from client.drafters.bundle import find_bundle

    path = find_bundle(name, target)
    if path is None or path.parent.name != TARGET:
        pytest.skip(f"no {name} bundle for {TARGET} is shipped (train one: make train-pair)")
    return make_drafter(name, target=target)


@pytest.mark.parametrize("name", OWN)
def test_its_own_drafters_pick_their_bundle_and_change_no_token(pair, name):
    target, ids, plain = pair
    drafter = own_drafter(target, name)
    gen = generate(LocalVerifier(target), drafter, ids, NEW_TOKENS)
    assert gen.token_ids == plain
    assert gen.stats.acceptance_length > 1.2, gen.stats.acceptance_length  # trained: more than a token a round


@pytest.mark.parametrize(("name", "mode"), [("moa-tli1", "kv"), ("moa-tli1", "lsa"), ("moa-tli0", "lsa"),
                                            ("eagle", "hidden")])  # fmt: skip
def test_its_own_drafters_split_over_loopback_with_payloads(pair, name, mode):
    """Payloads sized for the 1.5B's 28 layers (kv: every layer's keys and values; lsa: the server's LSA memory)."""
    target, ids, plain = pair
    drafter = own_drafter(target, name)
    spec = next(s for s in drafter.payload_specs(("fp16",)) if s.form == mode)
    with served(target, max_sessions=2) as (address, _):  # the shipped bundles, as `splitspec serve` reads them
        remote = RemoteVerifier(address, fingerprint=target.fingerprint, drafter=drafter, spec=spec)
        try:
            gen = generate(remote, drafter, ids, NEW_TOKENS)
        finally:
            remote.shutdown()
    assert gen.token_ids == plain
    assert gen.stats.payload_bytes > 0


@pytest.mark.parametrize("name", ["moa-tli1", "eagle"])
def test_its_own_drafters_generate_through_a_cut_and_settle_to_the_plain_tokens(pair, name):
    """Offline: the drafter alone (MoA-TLI1 through the target's last layer) writes 12 tokens, then the target
    verifies them: the answer ends as plain decoding's."""
    from client.loop.offline import offline_token, settle_verify
    from client.verifiers import first_spec
    from shared.acceptance import SamplingParams

    target, ids, plain = pair
    drafter = own_drafter(target, name)
    verifier = LocalVerifier(target)
    opened = verifier.open(ids, SamplingParams(), spec=first_spec(verifier, drafter.payload_specs()))
    drafter.begin(ids + opened.new_tokens, opened.features)
    out = list(opened.new_tokens)
    while len(out) < 8:
        result = verifier.verify(drafter.propose(16))
        drafter.absorb(result.new_tokens, result.features)
        out += result.new_tokens
    tail = [offline_token(drafter) for _ in range(12)]
    assert None not in tail
    out += settle_verify(verifier, drafter, tail, max_nodes=16)
    while len(out) < NEW_TOKENS:
        result = verifier.verify(drafter.propose(16))
        drafter.absorb(result.new_tokens, result.features)
        out += result.new_tokens
    assert out[:NEW_TOKENS] == plain


def test_the_edge_endpoint_drafts_with_its_own_moa(pair):
    """`splitspec edge --model qwen2.5-coder-1.5b --drafter moa-tli1`: the OpenAI-compatible endpoint drafting with
    the bundle trained for the 1.5B answers greedily as plain decoding does, and samples with a seed."""
    import openai

    from client.apps.edge_pool import Edge
    from tests.test_edge import serve

    target, ids, plain = pair
    own_drafter(target, "moa-tli1")  # skips where it is not shipped
    with served(target, max_sessions=4) as (address, _):
        edge = Edge(address, "moa-tli1", model=TARGET, mode="draft")
        server, thread, url = serve(edge)
        try:
            client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
            reply = client.chat.completions.create(model=TARGET, messages=[{"role": "user", "content": PROMPT}],
                                                   max_tokens=NEW_TOKENS, temperature=0)  # fmt: skip
            assert reply.choices[0].message.content == target.tokenizer.decode(plain, skip_special_tokens=True)
            assert reply.model_extra["splitspec"]["rounds"] >= 1
            sampled = client.chat.completions.create(model=TARGET, messages=[{"role": "user", "content": PROMPT}],
                                                     max_tokens=16, temperature=0.7, seed=3)  # fmt: skip
            assert sampled.usage.completion_tokens >= 1
        finally:
            server.should_exit = True
            thread.join(timeout=10)


def test_the_folder_a_gguf_stands_for_holds_the_tokenizer_autotokenizer_makes(tmp_path):
    """``folder_for`` takes the tokenizer class registered for the config's type instead of AutoTokenizer (which
    parses the header once more): the files it saves must be AutoTokenizer's, byte for byte."""
    from transformers import AutoTokenizer

    from shared.engine.gguf import folder_for

    try:
        path = gguf_path(DRAFTER, cache_dir())
    except SplitspecError as exc:
        pytest.skip(str(exc))
    folder = folder_for(path, tmp_path)
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(tmp_path / "auto")
    saved = sorted(p.name for p in (tmp_path / "auto").iterdir())
    assert saved and {p: (folder / p).read_bytes() for p in saved} == {
        p: (tmp_path / "auto" / p).read_bytes() for p in saved}
