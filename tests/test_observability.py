"""The server as operators see it: gRPC health (NOT_SERVING until the model is loaded), reflection,
Prometheus metrics that count what happened, and one structured log line per session."""

from __future__ import annotations

import json
import logging
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client import generate_latest

from server.limits import ServerLimits
from server.observability import SERVICE
from server.service import build_server
from shared.tree import DraftTree
from shared.wire import splitspec_pb2 as pb
from shared.wire import splitspec_pb2_grpc as pb_grpc

TIMEOUT = 30.0


@pytest.fixture
def unloaded():
    """A server listening before its model is loaded: (channel, service)."""
    server, port, service = build_server(None, "127.0.0.1", 0, ServerLimits(max_sessions=4, max_tree_nodes=16))
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield channel, service
    channel.close()
    server.stop(grace=None)
    service.close()


def health(channel, name: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=TIMEOUT).status


def test_health_says_not_serving_until_the_model_is_loaded(unloaded, tiny_target):
    channel, service = unloaded
    stub = pb_grpc.SplitSpecStub(channel)
    assert health(channel) == health(channel, SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.RpcError) as info:
        stub.Handshake(pb.HandshakeRequest(), timeout=TIMEOUT)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "loading" in info.value.details()
    service.attach(tiny_target)
    assert health(channel) == health(channel, SERVICE) == health_pb2.HealthCheckResponse.SERVING
    assert stub.Handshake(pb.HandshakeRequest(), timeout=TIMEOUT).vocab_size == tiny_target.vocab_size


def test_reflection_lists_the_services(unloaded):
    channel, _ = unloaded
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                        timeout=TIMEOUT)  # fmt: skip
    names = {s.name for reply in replies for s in reply.list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health"} <= names


def metric(text: str, name: str, labels: str = "") -> float:
    """The value of ``name{labels}`` in Prometheus' text format."""
    for line in text.splitlines():
        if line.startswith(f"{name}{{{labels}}} " if labels else f"{name} "):
            return float(line.split()[-1])
    raise AssertionError(f"no {name}{{{labels}}} in the metrics")


def test_metrics_count_what_happened_and_a_session_logs_one_line(unloaded, tiny_target, caplog):
    channel, service = unloaded
    service.attach(tiny_target)
    stub = pb_grpc.SplitSpecStub(channel)
    with caplog.at_level(logging.INFO, logger="splitspec.sessions"):
        opened = stub.OpenSession(pb.OpenSessionRequest(prompt_ids=[5, 6, 7, 8]), timeout=TIMEOUT)
        length = opened.length
        tree = DraftTree([9, 10, 11], [-1, 0, 0])
        for _ in range(3):
            reply = stub.Verify(pb.VerifyRequest(session_id=opened.session_id, tokens=tree.tokens,
                                                 parents=tree.parents, length=length), timeout=TIMEOUT)  # fmt: skip
            length = reply.length
        with pytest.raises(grpc.RpcError):
            stub.Verify(pb.VerifyRequest(session_id="nope"), timeout=TIMEOUT)
        text = generate_latest(service.metrics.registry).decode()
        assert metric(text, "splitspec_sessions") == 1
        assert metric(text, "splitspec_tokens_verified_total") == 9
        assert metric(text, "splitspec_verify_seconds_count") == 3
        assert metric(text, "splitspec_forward_tokens_count") == 4  # the prompt's one piece and three trees
        assert metric(text, "splitspec_refusals_total", 'code="NOT_FOUND",method="Verify"') == 1
        assert metric(text, "splitspec_kv_bytes") > 0
        stub.CloseSession(pb.CloseSessionRequest(session_id=opened.session_id), timeout=TIMEOUT)
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "splitspec.sessions"]
    assert len(lines) == 1 and lines[0]["reason"] == "closed" and lines[0]["rounds"] == 3 and lines[0]["nodes"] == 9
    server, _ = service.metrics.serve("127.0.0.1", 0)  # and over HTTP, as Prometheus scrapes it
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        body = urllib.request.urlopen(url, timeout=TIMEOUT).read().decode()
        assert metric(body, "splitspec_tokens_verified_total") == 9 and metric(body, "splitspec_sessions") == 0
    finally:
        server.shutdown()
