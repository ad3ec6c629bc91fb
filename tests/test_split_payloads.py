"""Split MoA/EAGLE over gRPC: payload forms and precisions, chunked prefills, bad payloads, bundle checks.

Everything on the tiny random Llama with random drafters saved as bundles in the test: the
assertions are about exactness (outputs, and for fp32 payloads the drafts themselves) and about
errors, not about how good the drafts are.
"""

from __future__ import annotations

import json

import grpc
import pytest

from client.drafters import drafter_for
from client.drafters.base import NoDrafter
from client.drafters.bundle import save_bundle
from client.loop.decode import Settings, generate
from client.net.remote import RemoteVerifier
from client.verifiers import LocalVerifier
from shared.errors import SplitspecError
from shared.payload import PayloadSpec
from shared.wire import splitspec_pb2 as pb
from tests.test_eagle_independent import make_model
from tests.test_moa import make_moa

PROMPT = [5, 9, 14, 5, 9, 21, 33, 40, 41, 5, 9]
NEW = 24


@pytest.fixture(scope="module")
def bundles(tiny_target, tmp_path_factory):
    """Random MoA TLI 0/1 and EAGLE bundles for the tiny target, in one folder the server reads."""
    root = tmp_path_factory.mktemp("bundles")
    for tli in (0, 1):
        save_bundle(make_moa(tiny_target, tli, seed=tli), root / f"moa-tli{tli}", tiny_target, {}, "float32")
    save_bundle(make_model(tiny_target, "eagle"), root / "eagle", tiny_target, {}, "float32")
    return root


@pytest.fixture(scope="module")
def server(tiny_target, bundles):
    from server.limits import ServerLimits
    from server.service import build_server

    # min_tree_nodes = every node: trees are never cut to the load the budget measured, so rounds match in-process
    limits = ServerLimits(max_sessions=4, max_tree_nodes=16, max_context=128, max_inline_payload_bytes=2048,
                          min_tree_nodes=16)
    srv, port, service = build_server(tiny_target, "127.0.0.1", 0, limits, bundle_dirs=(bundles,))
    srv.start()
    yield f"127.0.0.1:{port}", service
    srv.stop(grace=None)


def load(tiny_target, bundles, name: str):
    from client.drafters.bundle import load_bundle

    model, config = load_bundle(bundles / name, tiny_target)
    drafter = drafter_for(model, name=config["name"], width=3, depth=3)
    drafter.bundle = bundles / name
    return drafter


def remote(address: str, drafter, mode: str = "kv", precision: str = "fp16") -> tuple[RemoteVerifier, PayloadSpec]:
    """A verifier for ``drafter`` and the payload spec its generations ask for."""
    specs = drafter.payload_specs((precision,))
    spec = next((s for s in specs if s.form == mode), specs[0])  # EAGLE has one mode: hidden
    return RemoteVerifier(address, drafter=drafter, spec=spec), spec


@pytest.fixture(scope="module")
def plain(tiny_target):
    return generate(LocalVerifier(tiny_target), NoDrafter(), PROMPT, NEW).token_ids


@pytest.mark.parametrize("name", ["moa-tli0", "moa-tli1", "eagle"])
@pytest.mark.parametrize("mode", ["kv", "lsa"])
@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8", "int4"])
def test_split_greedy_output_equals_the_target_for_every_mode_and_precision(
    tiny_target, bundles, server, plain, name, mode, precision
):
    if name == "eagle" and mode == "lsa":
        pytest.skip("EAGLE's payload is its hidden state; lsa is a MoA mode")
    drafter = load(tiny_target, bundles, name)
    verifier, spec = remote(server[0], drafter, mode, precision)
    try:
        got = generate(verifier, drafter, PROMPT, NEW, Settings(max_tree_nodes=8, spec=spec))
    finally:
        verifier.shutdown()
    assert got.token_ids == plain
    assert got.stats.payload_bytes > 0 and got.stats.payload_bytes_per_token > 0
    if precision == "fp32":  # exact features: the very same drafts as with the target in-process
        local = generate(
            LocalVerifier(tiny_target), load(tiny_target, bundles, name), PROMPT, NEW,
            Settings(max_tree_nodes=8),
        )  # fmt: skip
        assert got.stats.rounds == local.stats.rounds
        assert got.stats.acceptance_length == pytest.approx(local.stats.acceptance_length)


def test_lsa_mode_ships_far_fewer_bytes_than_kv(tiny_target, bundles, server):
    sizes = {}
    for mode in ("kv", "lsa"):
        drafter = load(tiny_target, bundles, "moa-tli0")
        verifier, spec = remote(server[0], drafter, mode, "fp16")
        try:
            gen = generate(verifier, drafter, PROMPT, NEW, Settings(max_tree_nodes=8, spec=spec))
            sizes[mode] = gen.stats.payload_bytes
        finally:
            verifier.shutdown()
    # tiny target: kv is L x 2·n_kv·d = 2 x 64 values per token, the memory E = 64 values
    assert sizes["lsa"] < 0.7 * sizes["kv"]


def test_a_prefill_too_big_to_inline_is_streamed_in_chunks(tiny_target, bundles, server, plain):
    """max_inline_payload_bytes is 2 KB here: the prompt's kv (~11 x 2 x 128 fp16 values) must be fetched."""
    drafter = load(tiny_target, bundles, "moa-tli1")
    verifier, spec = remote(server[0], drafter, "kv", "fp32")
    calls = []
    original = verifier.connection.stub.FetchPayload

    def fetch(request, **kw):
        chunks = list(original(request, **kw))
        calls.append((request.start, request.end, len(chunks)))
        return iter(chunks)

    verifier.connection.stub.FetchPayload = fetch
    try:
        got = generate(verifier, drafter, PROMPT, NEW, Settings(max_tree_nodes=8, spec=spec))
    finally:
        verifier.shutdown()
    assert got.token_ids == plain
    assert calls and calls[0][:2] == (0, len(PROMPT)) and calls[0][2] >= 2  # the whole prompt, in several chunks


def corrupt(payload: pb.Payload) -> None:
    data = bytearray(payload.tensors[0].data)
    data[-3] ^= 0xFF
    payload.tensors[0].data = bytes(data)


class Tampered:
    """A unary stub method whose replies pass through ``change`` (the verifier calls it as ``.future``)."""

    def __init__(self, call, change):
        self.call, self.change = call, change

    def future(self, request, **kw):
        inner, change = self.call.future(request, **kw), self.change

        class Future:
            """gRPC's future (``done``, ``cancel``, ...) whose result passes through ``change``."""

            def result(self, timeout=None):
                return change(inner.result(timeout))

            def __getattr__(self, name):
                return getattr(inner, name)

        return Future()


def test_a_corrupted_payload_is_fetched_again_and_nothing_changes(tiny_target, bundles, server, plain):
    drafter = load(tiny_target, bundles, "moa-tli0")
    verifier, spec = remote(server[0], drafter, "lsa", "int8")
    hits = []

    def change(reply):
        if len(hits) == 2 and reply.payload.tensors:
            corrupt(reply.payload)
        hits.append(1)
        return reply

    verifier.connection.stub.Verify = Tampered(verifier.connection.stub.Verify, change)
    try:
        got = generate(verifier, drafter, PROMPT, NEW, Settings(max_tree_nodes=8, spec=spec))
    finally:
        verifier.shutdown()
    assert got.token_ids == plain
    assert verifier.counters.payload_refetches == 1


def test_a_payload_that_never_decodes_ends_with_a_clear_error(tiny_target, bundles, server):
    drafter = load(tiny_target, bundles, "moa-tli0")
    verifier, spec = remote(server[0], drafter, "kv", "fp16")
    original_fetch = verifier.connection.stub.FetchPayload

    def change(reply):
        if reply.payload.tensors:
            corrupt(reply.payload)
        return reply

    def fetch(request, **kw):
        for chunk in original_fetch(request, **kw):
            data = bytearray(chunk.tensors[0].data)
            data[4] = 99  # the header's codec version
            chunk.tensors[0].data = bytes(data)
            yield chunk

    stub = verifier.connection.stub
    stub.Verify, stub.FetchPayload = Tampered(stub.Verify, change), fetch
    try:
        with pytest.raises(SplitspecError, match=r"does not decode after 2 re-requests.*version 99"):
            generate(verifier, drafter, PROMPT, NEW, Settings(max_tree_nodes=8, spec=spec))
    finally:
        verifier.shutdown()


def test_handshake_refuses_a_bundle_that_does_not_fit(tiny_target, bundles, tmp_path):
    from server.service import build_server

    foreign = tmp_path / "moa-foreign"  # (a foreign bundle of a name the target has its own of would not be picked)
    foreign.mkdir()
    (foreign / "weights.safetensors").write_bytes((bundles / "moa-tli0" / "weights.safetensors").read_bytes())
    config = json.loads((bundles / "moa-tli0" / "config.json").read_text())
    config["target"]["tokenizer_fingerprint"] = "0123456789abcdef"
    (foreign / "config.json").write_text(json.dumps(config))
    other_shape = tmp_path / "moa-wide"
    other_shape.mkdir()
    (other_shape / "weights.safetensors").write_bytes((bundles / "moa-tli0" / "weights.safetensors").read_bytes())
    config = json.loads((bundles / "moa-tli0" / "config.json").read_text())
    config["target"]["hidden_size"] *= 2
    (other_shape / "config.json").write_text(json.dumps(config))
    srv, port, _ = build_server(tiny_target, "127.0.0.1", 0, bundle_dirs=(tmp_path, bundles))
    srv.start()
    address = f"127.0.0.1:{port}"
    try:
        cases = [  # (drafter named, bundle the client holds, what the refusal says)
            ("moa-foreign", "moa-tli0", "was trained for target .*tokenizer 0123456789abcdef"),
            ("moa-tli1", "moa-tli0", "the server's bundle 'moa-tli1' has weights"),
            ("eagle", "eagle", "only MoA bundles have an LSA"),
            ("moa-tli9", "moa-tli0", "has no drafter bundle 'moa-tli9'"),
            ("moa-wide", "moa-tli0", "expects a target with hidden_size=128, this one has 64"),
        ]
        for name, held, message in cases:
            with pytest.raises(SplitspecError, match=f"FAILED_PRECONDITION: .*{message}"):
                RemoteVerifier(address, spec=PayloadSpec("lsa", drafter=name), bundle=bundles / held)
    finally:
        srv.stop(grace=None)


def test_bad_payload_requests_get_clear_statuses(tiny_target, bundles, server):
    stub = RemoteVerifier(server[0]).connection.stub
    sampling = pb.Sampling()

    def status(call):
        with pytest.raises(grpc.RpcError) as info:
            call()
        return info.value.code(), info.value.details()

    code, details = status(lambda: stub.OpenSession(pb.OpenSessionRequest(
        prompt_ids=PROMPT, sampling=sampling, payload=pb.PayloadSpec(form="everything"))))  # fmt: skip
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "payload form 'everything' is not one of" in details
    code, details = status(lambda: stub.OpenSession(pb.OpenSessionRequest(
        prompt_ids=PROMPT, sampling=sampling, payload=pb.PayloadSpec(form="kv", precision="int3"))))  # fmt: skip
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "precision 'int3'" in details
    code, details = status(lambda: stub.OpenSession(pb.OpenSessionRequest(
        prompt_ids=PROMPT, sampling=sampling, payload=pb.PayloadSpec(form="lsa", drafter="moa-tli7"))))  # fmt: skip
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "'moa-tli7' was not named at Handshake" in details
    code, details = status(lambda: stub.OpenSession(pb.OpenSessionRequest(
        prompt_ids=PROMPT, sampling=sampling, payload=pb.PayloadSpec(form="hidden", tli_layers=99))))  # fmt: skip
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "tli_layers 99 exceeds" in details

    opened = stub.OpenSession(pb.OpenSessionRequest(prompt_ids=PROMPT, sampling=sampling,
                                                    payload=pb.PayloadSpec(form="kv")))  # fmt: skip
    sid = opened.session_id
    code, details = status(lambda: list(stub.FetchPayload(pb.FetchPayloadRequest(
        session_id=sid, start=3, end=len(PROMPT) + 5, spec=pb.PayloadSpec(form="kv")))))  # fmt: skip
    assert code == grpc.StatusCode.OUT_OF_RANGE and f"not within the {len(PROMPT)} cached tokens" in details
    code, details = status(lambda: stub.Verify(pb.VerifyRequest(session_id=sid, payload=pb.PayloadSpec(form="hidden"))))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "opened without payload form 'hidden'" in details
    # the session survived every refusal: it still verifies and ships its payload
    reply = stub.Verify(pb.VerifyRequest(session_id=sid, payload=pb.PayloadSpec(form="kv")))
    assert reply.length == len(PROMPT) + 2 and reply.payload.start == len(PROMPT) and reply.payload.count == 1


def test_the_loop_asks_for_what_the_drafter_declares_and_refuses_what_it_cannot_use(tiny_target, bundles, server,
                                                                                  plain):  # fmt: skip
    """A drafter's payload specs are its one declaration of needs: a verifier told nothing opens with the first
    one it can send (kv here: the server was not asked to run this MoA's LSA); a spec the drafter cannot use
    is refused before anything is sent."""
    drafter = load(tiny_target, bundles, "moa-tli0")
    verifier = RemoteVerifier(server[0])
    try:
        gen = generate(verifier, drafter, PROMPT, NEW)
        assert gen.token_ids == plain and gen.spec == PayloadSpec("kv", "fp16")
        calls = verifier.counters.server_calls
        with pytest.raises(SplitspecError, match="cannot use payload form 'hidden'; it takes kv, lsa"):
            generate(
                verifier, load(tiny_target, bundles, "moa-tli0"), PROMPT, NEW,
                Settings(spec=PayloadSpec("hidden")),
            )
        assert verifier.counters.server_calls == calls
    finally:
        verifier.shutdown()


@pytest.mark.parametrize("form", ["kv", "hidden", "lsa"])
def test_a_payload_of_no_tokens_encodes_and_decodes_in_every_form(form):
    """A drafter that holds every feature of a repeated prompt asks for none (``payload_from`` at the cache's end):
    the opening's payload is then empty, and every form, the server-run LSA included, encodes and decodes it."""
    import torch

    from shared import payload
    from shared.lsa import LayerSelfAttention

    layers, kv_width, hidden_size = 3, 8, 16
    lsa = LayerSelfAttention(layers, kv_width, hidden_size, lsa_dim=8, lsa_heads=2, lsa_mlp_hidden=16, eps=1e-5)
    spec = PayloadSpec(form, "fp16", 0, "moa" if form == "lsa" else "")
    for n in (0, 2):
        kv, hidden = torch.randn(n, layers, kv_width), torch.randn(n, hidden_size)
        msg = payload.encode(7, payload.tensors_for(spec, kv, hidden, lsa), spec.precision)
        got = payload.decode(msg, payload.expected_shapes(spec, msg.count, layers, kv_width, hidden_size))
        assert got.start == 7 and msg.count == n and len(got) == n
