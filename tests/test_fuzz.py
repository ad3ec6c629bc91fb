"""A bounded fuzz run in the suite: hostile requests on every RPC never get INTERNAL or UNKNOWN, never take the
server down, and a canary session keeps decoding exactly — though the fuzzer holds its id, the canary's
session belongs to another token (``make fuzz`` runs 10,000 requests on the real target)."""

from __future__ import annotations

from bench.fuzz import Canary, run
from client.net.endpoint import Endpoint
from server.limits import ServerLimits
from server.service import build_server
from shared.tree import DraftTree
from shared.wire import splitspec_pb2_grpc as pb_grpc

PROMPT = [1, 3, 100, 7, 200, 13, 42]
CANARY, FUZZER = "c" * 32, "f" * 32


def test_hostile_requests_break_nothing(tiny_target):
    session = tiny_target.session()
    session.prefill(PROMPT)
    while len(session.tokens) < len(PROMPT) + 100:
        session.verify(DraftTree())
    reference = session.tokens[len(PROMPT) :]
    limits = ServerLimits(max_sessions=64, max_tree_nodes=16, max_context=128, max_new_tokens=64,
                          max_inline_payload_bytes=4096)  # fmt: skip
    server, port, service = build_server(tiny_target, "127.0.0.1", 0, limits, tokens={CANARY: "canary",
                                                                                     FUZZER: "fuzzer"})  # fmt: skip
    server.start()
    address = f"127.0.0.1:{port}"
    try:
        with Endpoint(address, token=CANARY).channel() as mine, Endpoint(address, token=FUZZER).channel() as theirs:
            canary = Canary(pb_grpc.SplitSpecStub(mine), PROMPT, reference)
            tally = run(theirs, tiny_target.vocab_size, 400, canary, seed=1, others=[canary.id])
    finally:
        server.stop(grace=None)
        service.close()
    assert not tally.bad, tally.bad[:10]
    assert tally.canary_checks >= 10 and tally.codes["OK"] > 0
    assert {"INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION"} <= set(tally.codes)  # refusals of several kinds
