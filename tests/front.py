"""A gRPC front for one splitspec server, as a replica router is (Ray Serve's proxy), that fails on purpose.

It forwards every call, bytes as they are, and can be told to *hold* calls instead: accept them and answer nothing,
as a proxy does whose replica died behind it while it keeps the client's connection open. What is held, by rule:

* ``hold(method, route=..., when="before")``: the next calls of ``method`` (of one session's route key, or any) are
  held before they reach the server; ``when="after"``: the server runs them and the reply is held (its state moved,
  the client never hears it); ``after_messages=k``: a stream's first k messages pass, the rest are held.
* ``hold_all(calls)``: every call, Handshake and Probe included, until ``calls`` calls have been held (a front that
  hangs, then recovers: released by count, not by a clock).

Held calls end (UNAVAILABLE) when the front stops, or after ``HOLD_CAP_S``: nothing outlives a test. ``held`` counts
what was held, per method (a chained Verify, sent before the verdict of the one it follows, apart: "Verify chained").
"""

from __future__ import annotations

import threading
from collections import Counter
from concurrent import futures
from dataclasses import dataclass

import grpc

from shared.channel import MESSAGE_OPTIONS, ROUTE_KEY
from shared.wire import splitspec_pb2 as pb

SERVICE = "/splitspec.v1.SplitSpec/"
STREAMS = {"Complete", "Generate", "FetchPayload", "Decode"}
HOLD_CAP_S = 60.0  # the longest a held call waits for the front to stop


@dataclass
class Rule:
    method: str
    route: str | None  # None: any call of the method
    when: str  # "before" | "after"
    after_messages: int  # streams: messages that pass before the rest are held
    times: int  # calls it still holds


class Front(grpc.GenericRpcHandler):
    def __init__(self, backend: str, workers: int = 32):
        self.backend = grpc.insecure_channel(backend, options=MESSAGE_OPTIONS)
        self.rules: list[Rule] = []
        self.all_left = 0  # calls ``hold_all`` still holds
        self.held: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=MESSAGE_OPTIONS)
        self.server.add_generic_rpc_handlers([self])
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def hold(self, method: str, route: str | None = None, when: str = "before", after_messages: int = 0,
             times: int = 1) -> None:  # fmt: skip
        with self._lock:
            self.rules.append(Rule(method, route, when, after_messages, times))

    def hold_all(self, calls: int) -> None:
        with self._lock:
            self.all_left = calls

    def stop(self) -> None:
        self._stopped.set()
        self.server.stop(grace=None)
        self.backend.close()

    # --- forwarding ---

    def _rule(self, method: str, metadata: dict) -> Rule | str | None:
        """What holds this call: a rule, "all", or nothing."""
        with self._lock:
            self.calls[method] += 1
            if self.all_left > 0:
                self.all_left -= 1
                return "all"
            for rule in self.rules:
                if rule.method == method and rule.times > 0 and rule.route in (None, metadata.get(ROUTE_KEY)):
                    rule.times -= 1
                    return rule
        return None

    def _hold(self, method: str, context: grpc.ServicerContext) -> None:
        """Answer nothing until the front stops or the caller gives up (bounded: ``HOLD_CAP_S``)."""
        with self._lock:
            self.held[method] += 1
        for _ in range(int(HOLD_CAP_S / 0.05)):
            if self._stopped.wait(0.05) or not context.is_active():
                break
        context.abort(grpc.StatusCode.UNAVAILABLE, "front: held until it stopped")

    def service(self, details: grpc.HandlerCallDetails):
        if not details.method.startswith(SERVICE):
            return None
        method = details.method.removeprefix(SERVICE)
        if method in STREAMS:
            return grpc.unary_stream_rpc_method_handler(lambda request, context: self._stream(method, request, context))
        return grpc.unary_unary_rpc_method_handler(lambda request, context: self._unary(method, request, context))

    def _forwarded(self, context: grpc.ServicerContext) -> dict:
        remaining = context.time_remaining()
        return {"metadata": tuple(context.invocation_metadata()), "timeout": remaining}

    def _unary(self, method: str, request: bytes, context: grpc.ServicerContext) -> bytes:
        rule = self._rule(method, dict(context.invocation_metadata()))
        if method == "Verify" and pb.VerifyRequest.FromString(request).assumed:
            method = "Verify chained"  # (counted apart; forwarded as a Verify)
        if rule is not None and (rule == "all" or rule.when == "before"):
            self._hold(method, context)
        try:
            reply = self.backend.unary_unary(SERVICE + method.removesuffix(" chained"))(request,
                                                                                       **self._forwarded(context))
        except grpc.RpcError as exc:
            context.abort(exc.code(), exc.details() or "")
        if rule is not None:  # "after": the server ran it, the client never hears of it
            self._hold(method, context)
        return reply

    def _stream(self, method: str, request: bytes, context: grpc.ServicerContext):
        rule = self._rule(method, dict(context.invocation_metadata()))
        if rule is not None and (rule == "all" or (rule.when == "before" and rule.after_messages == 0)):
            self._hold(method, context)
        call = self.backend.unary_stream(SERVICE + method)(request, **self._forwarded(context))
        try:
            for i, message in enumerate(call):
                if rule is not None and i >= rule.after_messages:
                    call.cancel()
                    self._hold(method, context)
                yield message
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                context.abort(exc.code(), exc.details() or "")
