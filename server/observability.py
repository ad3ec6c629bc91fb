"""What the server tells the outside about itself: gRPC health and reflection, Prometheus metrics, session logs.

Well-kept libraries do the work: ``grpcio-health-checking`` (the standard ``grpc.health.v1`` service
that load balancers and ``grpc_health_probe`` ask; NOT_SERVING until the model is loaded),
``grpcio-reflection`` (``grpcurl`` can list and call the API without the proto) and
``prometheus-client`` (metrics in the text format on an HTTP port of their own). Each server has a
registry of its own, so several in one process (the tests) do not mix their figures.
"""

from __future__ import annotations

import json
import logging
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from shared.wire import splitspec_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["SplitSpec"].full_name
log = logging.getLogger("splitspec.sessions")


class Metrics:
    """The server's figures; ``store`` (the session store) and ``waiting()`` (steps queued for the model) are
    read when scraped."""

    def __init__(self, store, waiting, prefixes=None) -> None:
        self.registry = r = CollectorRegistry()
        Gauge("splitspec_sessions", "open sessions", registry=r).set_function(lambda: len(store))
        Gauge("splitspec_kv_bytes", "KV cache bytes held by sessions and places being opened",
              registry=r).set_function(lambda: store.nbytes)  # fmt: skip
        Gauge("splitspec_queue_depth", "steps waiting for a forward", registry=r).set_function(waiting)
        Gauge("splitspec_sessions_evicted", "idle sessions evicted to admit new ones",
              registry=r).set_function(lambda: store.evicted)  # fmt: skip
        Gauge("splitspec_sessions_expired", "sessions reaped after the TTL", registry=r).set_function(
            lambda: store.expired)
        if prefixes is not None:
            for name, help, read in (
                ("hit_tokens", "prompt tokens whose KV came from the prefix cache", lambda: prefixes.hit_tokens),
                ("miss_tokens", "prompt tokens prefilled (not in the prefix cache)", lambda: prefixes.miss_tokens),
                ("evictions", "prefix cache entries evicted for room", lambda: prefixes.evictions),
                ("bytes", "KV bytes the prefix cache holds", lambda: prefixes.nbytes),
                ("entries", "sequences the prefix cache holds", lambda: len(prefixes)),
            ):
                Gauge(f"splitspec_prefix_{name}", help, registry=r).set_function(read)
        self.forward_tokens = Histogram("splitspec_forward_tokens", "tokens per target forward (prefill pieces, "
                                        "trees with their root, decode steps)", registry=r,
                                        buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))  # fmt: skip
        self.forward_sessions = Histogram("splitspec_forward_sessions", "sessions per target forward (batch size)",
                                          registry=r, buckets=(1, 2, 4, 8, 16, 32))  # fmt: skip
        self.forward_seconds = Counter("splitspec_forward_seconds", "time spent in target forwards",
                                       registry=r)  # fmt: skip
        self.verify_seconds = Histogram("splitspec_verify_seconds", "Verify calls, from arrival to reply",
                                        registry=r, buckets=(.005, .01, .02, .05, .1, .2, .5, 1, 2, 5))  # fmt: skip
        self.tokens_verified = Counter("splitspec_tokens_verified", "draft nodes verified", registry=r)
        self.tree_nodes_cut = Counter("splitspec_tree_nodes_cut", "draft nodes sent but not verified: trees cut "
                                      "to what pays at the server's load", registry=r)
        self.chained_stale = Counter("splitspec_chained_stale", "chained Verify calls whose assumed tokens the round "
                                     "before did not commit: answered stale, nothing computed", registry=r)  # fmt: skip
        self.tokens_accepted = Counter("splitspec_tokens_accepted", "draft nodes accepted", registry=r)
        self.tokens_generated = Counter("splitspec_tokens_generated", "tokens committed (accepted + bonus, "
                                        "first tokens, streamed tokens)", registry=r)  # fmt: skip
        self.tokens_decoded = Counter("splitspec_tokens_decoded", "tokens the server decoded by itself for a session "
                                      "(stretches, Decode)", registry=r)
        self.payload_bytes = Counter("splitspec_payload_bytes", "encoded payload bytes sent", registry=r)
        self.refusals = Counter("splitspec_refusals", "requests refused, by method and status",
                                ["method", "code"], registry=r)  # fmt: skip

    def forward(self, steps: int, tokens: int, seconds: float) -> None:
        """One target forward of ``steps`` steps (sessions' trees, prompt pieces, decode steps), ``tokens`` in all."""
        self.forward_tokens.observe(tokens)
        self.forward_sessions.observe(steps)
        self.forward_seconds.inc(seconds)

    def serve(self, host: str, port: int):
        """The metrics on http://host:port/metrics (a thread of their own); returns (server, thread)."""
        return start_http_server(port, addr=host, registry=self.registry)


class RouteMetrics:
    """Where a replica of ``splitspec serve --ray`` stands in routing: the session calls that found their session
    here, and those that did not (their route key was held by no live replica; the client reopens)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.hits = Counter("splitspec_route_hits", "session calls routed to the replica holding the session",
                            registry=registry)  # fmt: skip
        self.misses = Counter("splitspec_route_misses", "session calls routed to a replica without the session "
                              "(answered NOT_FOUND; the client reopens from its history)", registry=registry)


class RayMirror:
    """A registry's current figures copied into Ray's metrics (``ray.serve.metrics``, which tags them with the
    application, deployment and replica): every sample as a gauge of the same name (Ray prefixes ``ray_``), so
    Ray's metrics port shows each replica's figures beside Serve's own."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.gauges = {}

    def push(self) -> None:
        from ray.serve.metrics import Gauge as RayGauge

        for family in self.registry.collect():
            for sample in family.samples:
                if sample.name.endswith("_created"):  # prometheus_client's creation timestamps: not figures
                    continue
                gauge = self.gauges.get(sample.name)
                if gauge is None:
                    gauge = self.gauges[sample.name] = RayGauge(sample.name, family.documentation,
                                                                tag_keys=tuple(sample.labels))  # fmt: skip
                gauge.set(sample.value, tags=dict(sample.labels) or None)


def add_health_and_reflection(server: grpc.Server) -> health.HealthServicer:
    """Register both services; health says NOT_SERVING (overall and for SplitSpec) until ``set_serving``."""
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for name in ("", SERVICE):
        servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    names = (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    return servicer


def set_serving(servicer: health.HealthServicer, serving: bool = True) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", SERVICE):
        servicer.set(name, status)


def log_session(session, reason: str) -> None:
    """One structured line per session, when it ends (closed, evicted, expired, failed)."""
    s = session.stats
    log.info(json.dumps({
        "event": "session_end", "session": session.id[:8], "owner": session.owner or None, "reason": reason,
        "age_s": round(time.monotonic() - s.opened, 3), "prompt_tokens": s.prompt_tokens,
        "reused_tokens": s.reused_tokens, "tokens": len(session.sequence.tokens), "rounds": s.rounds,
        "nodes": s.nodes, "accepted": s.accepted,
        "decoded": s.decoded, "verify_s": round(s.verify_s, 4), "payload_bytes": s.payload_bytes,
    }))  # fmt: skip
