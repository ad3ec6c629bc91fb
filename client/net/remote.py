"""The remote ``Verifier``: a splitspec server over gRPC. It turns the loop's trees into calls on its
``client.net.connection.Connection`` (which bounds, times and counts them, and keeps the link measured) and their
replies into ``Verdict``s, decoding the payloads that come with them."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import grpc

from client.net.connection import SHUTDOWN_JOIN_S, Connection, LinkCounters, _say
from client.net.deadlines import GRACE_S
from client.net.endpoint import Endpoint
from client.net.failures import LinkDown, Stale
from client.verifiers import NO_PAYLOAD, Pending, Verifier
from shared import payload
from shared.acceptance import SamplingParams
from shared.channel import off_thread
from shared.codec import CodecError
from shared.engine.target import Verdict
from shared.errors import SplitspecError
from shared.features import Features
from shared.payload import PayloadSpec
from shared.tree import DraftTree
from shared.wire import splitspec_pb2 as pb

PAYLOAD_RETRIES = 2  # a payload that does not decode is fetched again this many times before giving up


def sampling_msg(sampling: SamplingParams) -> pb.Sampling:
    return pb.Sampling(temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed,
                       acceptance=sampling.acceptance, epsilon=sampling.epsilon, delta=sampling.delta)  # fmt: skip


class RemoteVerifier(Verifier):
    """A splitspec server reached over gRPC; checks at connect that both sides share a tokenizer.

    Each call's ``spec`` says which features of newly cached tokens the server sends with its reply.
    Given a ``drafter`` whose needs include form ``lsa``, the Handshake names its bundle (the server
    compares the weights digest with its own copy and loads the LSA); a server that cannot run it
    leaves form lsa unusable, with a warning, unless ``spec`` (the payload the caller pins, if any; only the
    Handshake reads it) pins lsa: then that is an error. ``bundle``:
    the folder whose weights digest is sent (default: the drafter's).

    A full server refuses a new session with a retry hint; the opening calls wait for a place for up to
    ``admission_s`` (default: one call's deadline), saying so through ``say`` (default: a line on stderr).

    Threads: the decode loop calls from one thread; the heartbeat's ``abort`` and the reconnection polls
    (``reachable``) come from others. ``_lock`` guards what they share: the channel and stub (a failed poll
    replaces them) and the call in flight with its abort reason.
    """

    def __init__(
        self,
        address: str | Endpoint,
        fingerprint: str = "",
        connect_timeout_s: float = 10.0,
        rpc_timeout_s: float = 120.0,
        drafter=None,
        spec: PayloadSpec = PayloadSpec(),
        bundle=None,
        admission_s: float | None = None,
        say: Callable[[str], None] = _say,
    ):
        endpoint = address if isinstance(address, Endpoint) else Endpoint(address)
        self.connection = c = Connection(endpoint, fingerprint, connect_timeout_s, rpc_timeout_s, admission_s, say)
        self.endpoint, self.address, self.link, self.bounds = c.endpoint, c.address, c.link, c.bounds
        self.session_id = ""
        self.length = 0
        self._closing: grpc.Future | None = None  # a CloseSession sent without waiting (see close)
        self.lsa_drafter = ""  # whose LSA the server runs for us (form lsa), if any
        lsa = [s for s in (drafter.payload_specs() if drafter is not None else []) if s.form == "lsa"]
        if spec.form == "lsa" or (lsa and not spec):
            name = spec.drafter if spec.form == "lsa" else lsa[0].drafter
            self._name_drafter(name, bundle or (drafter.bundle if drafter else None), pinned=spec.form == "lsa")
        info = self.info = c.info
        self.dims = (info.num_layers, 2 * info.num_kv_heads * info.head_dim, info.hidden_size)
        self.eos_token_ids = list(info.eos_token_ids)
        self.max_tree_nodes = info.limits.max_tree_nodes
        self.chains = info.limits.chained_verify
        self.max_context = info.limits.max_context

    @property
    def counters(self) -> LinkCounters:
        return self.connection.counters

    @counters.setter
    def counters(self, counters: LinkCounters) -> None:
        self.connection.counters = counters

    def reachable(self, timeout_s: float = 1.0) -> bool:
        return self.connection.reachable(timeout_s)

    def _name_drafter(self, name: str, bundle, pinned: bool) -> None:
        """Handshake again naming drafter ``name`` so the server runs its LSA; the hello is sent again on
        reconnection (a restarted server must load the LSA again)."""
        from shared.lsa import weights_digest

        if bundle is None:
            raise SplitspecError(f"payload form lsa needs the bundle of drafter {name!r}")
        c = self.connection
        hello = pb.HandshakeRequest()
        hello.CopyFrom(c.hello)
        hello.drafter, hello.drafter_digest = name, weights_digest(bundle)
        try:
            c.call("Handshake", hello, timeout_s=c.rpc_timeout_s)  # the server loads the drafter's LSA
        except LinkDown:
            raise
        except SplitspecError as exc:
            if pinned:
                raise
            c.say(f"payload form lsa unavailable ({exc}); using kv")
            return
        c.hello, self.lsa_drafter = hello, name

    def usable(self, specs: list[PayloadSpec]) -> list[PayloadSpec]:
        return [s for s in specs if s.form != "lsa" or s.drafter == self.lsa_drafter]

    # --- the Verifier interface ---

    def open(self, prompt_ids: list[int], sampling: SamplingParams, *, spec: PayloadSpec = NO_PAYLOAD,
             held: int = 0) -> Verdict:  # fmt: skip
        self._closed()
        request = pb.OpenSessionRequest(prompt_ids=prompt_ids, sampling=sampling_msg(sampling),
                                        payload=spec.to_msg(), payload_from=held)  # fmt: skip
        self.connection.backlog = int((len(prompt_ids) - held) * self.payload_bytes_per_token(spec))
        self.connection.route.follow(prompt_ids)
        bound = self.bounds.call_s(len(prompt_ids), request.ByteSize(), self.connection.backlog)
        try:
            reply = self.connection.admitted(lambda: self.connection.call("OpenSession", request, timeout_s=bound))
        finally:
            self.connection.backlog = 0
        self.bounds.observe(len(prompt_ids), reply.compute_s)
        self.session_id, self.length = reply.session_id, reply.length
        self.counters.reused_tokens += reply.reused_tokens
        before = self.counters.payload_bytes
        features = self._features(reply.payload, spec)
        self.counters.prefill_payload_bytes += self.counters.payload_bytes - before
        return Verdict([], [reply.first_token], reply.compute_s, features, load=reply.load)

    def verify(self, tree: DraftTree, timeout_s: float | None = None, *, spec: PayloadSpec = NO_PAYLOAD) -> Verdict:
        """One round; ``timeout_s`` overrides the call's bound (default: ``Bounds.call_s`` for the tree)."""
        request = pb.VerifyRequest(session_id=self.session_id, tokens=tree.tokens, parents=tree.parents,
                                   length=self.length, payload=spec.to_msg())  # fmt: skip
        reply = self.connection.call("Verify", request, self._bound(request, tree, spec, timeout_s))
        return self._verdict(tree, spec, reply)

    def verify_after(self, length: int, assumed: list[int], tree: DraftTree, timeout_s: float | None = None, *,
                     spec: PayloadSpec = NO_PAYLOAD) -> Pending:  # fmt: skip
        """Sent now; the reply is read and taken by ``verdict()`` only, on the loop's thread, after the round before's
        (whose reply sets the length this one's follows). Its wall time holds the wait for the round before: it does
        not time the link."""
        request = pb.VerifyRequest(session_id=self.session_id, tokens=tree.tokens, parents=tree.parents,
                                   length=length, assumed=assumed, payload=spec.to_msg())  # fmt: skip
        bound = self._bound(request, tree, spec, timeout_s)
        future = self.connection.start("Verify", request, bound)

        def verdict() -> Verdict:
            reply = self.connection.reply(future, "Verify", bound)
            self.connection.count(request, reply)
            if reply.stale:
                raise Stale(f"server {self.address}: the round before did not commit the {len(assumed)} tokens a "
                            "chained round assumed")  # fmt: skip
            return self._verdict(tree, spec, reply)

        def drop() -> None:
            self.connection.end(future)
            off_thread(future.cancel)

        return Pending(verdict, drop, future.done)

    def _bound(self, request: pb.VerifyRequest, tree: DraftTree, spec: PayloadSpec, timeout_s: float | None) -> float:
        """A Verify's bound: ``timeout_s``, else ``Bounds.call_s`` for the tree and its reply's payload."""
        down = int((len(tree) + 1) * self.payload_bytes_per_token(spec))
        return timeout_s or self.bounds.call_s(len(tree) + 1, request.ByteSize(), down)

    def _verdict(self, tree: DraftTree, spec: PayloadSpec, reply: pb.VerifyReply) -> Verdict:
        """A Verify's reply taken: the session's length moves on by it."""
        self.bounds.observe(len(tree) + 1, reply.compute_s)
        self.length = reply.length
        accepted = list(reply.accepted)
        new = [tree.tokens[i] for i in accepted] + [reply.bonus_token]
        verified = reply.verified or len(tree)  # 0: an older server, which verifies every node
        return Verdict(accepted, new, reply.compute_s, self._features(reply.payload, spec), verified, reply.load)

    def decode(self, max_new_tokens: int, stop_ids: list[int], payload_every: int = 1,
               timeout_s: float | None = None, self_draft: int = 0, *, spec: PayloadSpec = NO_PAYLOAD
               ) -> Iterator[Verdict]:  # fmt: skip
        """The server decodes the session by itself and streams each token with the payload of the token it cached
        (the Decode call): no round trip per token. Closing the iterator cancels the stream; the tokens the server
        made past what was received are the next call's first (its ``length`` says where). ``timeout_s`` bounds the
        whole stream (a silent cut is noticed by the heartbeat, which aborts it)."""
        request = pb.DecodeRequest(session_id=self.session_id, length=self.length, max_new_tokens=max_new_tokens,
                                   stop_token_ids=stop_ids, payload=spec.to_msg(),
                                   payload_every=payload_every, self_draft=self_draft)  # fmt: skip
        return self._decode(request, payload_every, timeout_s, spec)

    def open_decode(self, prompt_ids: list[int], sampling: SamplingParams, max_new_tokens: int, stop_ids: list[int],
                    payload_every: int = 1, timeout_s: float | None = None, self_draft: int = 0, *,
                    spec: PayloadSpec = NO_PAYLOAD, held: int = 0) -> Iterator[Verdict]:  # fmt: skip
        request = pb.DecodeRequest(prompt_ids=prompt_ids, sampling=sampling_msg(sampling),
                                   max_new_tokens=max_new_tokens, stop_token_ids=stop_ids, payload=spec.to_msg(),
                                   payload_every=payload_every, self_draft=self_draft, payload_from=held)  # fmt: skip
        self._closed()
        self.session_id, self.length = "", 0
        self.connection.route.follow(prompt_ids)
        return self._decode(request, payload_every, timeout_s, spec, prompt=len(prompt_ids))

    def _decode(self, request: pb.DecodeRequest, payload_every: int, timeout_s: float | None, spec: PayloadSpec,
                prompt: int = 0) -> Iterator[Verdict]:  # fmt: skip
        """A Decode call's chunks as rounds; ``prompt``: the prompt's length when the call opens the session (its
        features come with the first payload; a full server's refusal is waited out)."""
        c = self.counters
        timeout_s = timeout_s or self.connection.rpc_timeout_s + request.max_new_tokens
        per_token = self.payload_bytes_per_token(spec)
        self.connection.backlog = int((prompt + payload_every) * per_token)
        first_bound = self.bounds.call_s(max(prompt, 1), request.ByteSize(), self.connection.backlog)
        steps = max(1, request.self_draft + 1)  # a chunk may wait for the server's own draft, verified

        def gap_s(i: int) -> float:  # the first chunk waits for the prefill (or a step), the others for a step each
            return first_bound if i == 0 else self.bounds.call_s(steps, 0, self.connection.backlog)

        call = None
        try:
            call, start, chunks = self.connection.stream("Decode", request, timeout_s, gap_s, opens=bool(prompt))
            for i, chunk in enumerate(chunks):
                size, arrived = chunk.ByteSize(), time.perf_counter()
                self.bounds.observe(prompt if i == 0 and prompt else 1, chunk.compute_s)
                if i == 0:  # the first token is one round trip around a step; later ones are pipelined
                    self.link.observe(arrived - start, chunk.compute_s, request.ByteSize(), size)
                    self.session_id = chunk.session_id or self.session_id
                    c.reused_tokens += chunk.reused_tokens
                elif i == 1 and prompt:  # the prompt's features, after the small first chunk: the link's rate
                    self.link.observe_gap(arrived - start, chunk.compute_s, size)
                start = arrived
                self.connection.count(received=chunk)
                self.length, self.connection.last_heard = chunk.length, time.monotonic()
                features = None
                if chunk.HasField("payload"):
                    before = c.payload_bytes
                    features = self._features(chunk.payload, spec)
                    if prompt and features is not None and features.start < prompt:  # the prompt's, deferred
                        c.prefill_payload_bytes += c.payload_bytes - before
                        self.connection.backlog = int(payload_every * self.payload_bytes_per_token(spec))
                yield Verdict([], [chunk.token], chunk.compute_s, features,
                            load=chunk.load if chunk.HasField("load") else None)  # fmt: skip
        finally:
            self.connection.backlog = 0
            if call is not None:
                self.connection.end(call)
                off_thread(call.cancel)  # the consumer stopped early (a stop string, a switch): end the stream

    def payload_bytes_per_token(self, spec: PayloadSpec) -> float:
        """Raw bytes (before zstd) one token's payload takes in ``spec`` on this server's target."""
        return payload.raw_bytes_per_token(spec, *self.dims) if spec else 0.0

    def _features(self, msg: pb.Payload, spec: PayloadSpec) -> Features | None:
        """Decode a reply's payload in ``spec``; fetch it (again) when it is pending or does not decode."""
        if not spec:
            return None
        self.counters.payload_bytes += msg.ByteSize()
        shapes = payload.expected_shapes(spec, msg.count, *self.dims)
        error: Exception | None = None
        if not msg.pending:
            try:
                return payload.decode(msg, shapes)
            except CodecError as exc:
                error = exc
                self.counters.payload_refetches += 1
        for _ in range(PAYLOAD_RETRIES):
            try:
                return self.fetch(msg.start, msg.start + msg.count, spec)
            except CodecError as exc:
                error = exc
                self.counters.payload_refetches += 1
        raise SplitspecError(f"server {self.address}: payload for tokens [{msg.start}, {msg.start + msg.count}) "
                             f"does not decode after {PAYLOAD_RETRIES} re-requests: {error}")  # fmt: skip

    def fetch(self, start: int, end: int, spec: PayloadSpec) -> Features:
        """FetchPayload: the features of cached tokens [start, end) in ``spec``, streamed in chunks (those a cut kept
        from arriving, or a payload too big to ride inline)."""
        request = pb.FetchPayloadRequest(session_id=self.session_id, start=start, end=end, spec=spec.to_msg())
        self.connection.count(request)
        parts = []
        # each chunk may take what encoding and moving all the range would (the server reports no compute for it)
        bound = self.bounds.call_s(end - start, 0, int((end - start) * self.payload_bytes_per_token(spec)))
        call = self.connection.start("FetchPayload", request, self.connection.rpc_timeout_s, stream=True, watched=False)
        for chunk in self.connection.messages(call, "FetchPayload", lambda i: bound):  # not a link sample: see above
            self.counters.payload_bytes += self.connection.count(received=chunk)
            shapes = payload.expected_shapes(spec, chunk.count, *self.dims)
            parts.append(payload.decode(chunk, shapes))
        features = payload.concat(parts)
        if features.start != start or len(features) != end - start:
            got = f"[{features.start}, {features.start + len(features)})"
            raise CodecError(f"FetchPayload returned tokens {got}, asked for [{start}, {end})")
        return features

    def close(self, timeout_s: float | None = None, wait: bool = True) -> None:
        if not self.session_id:
            return
        request = pb.CloseSessionRequest(session_id=self.session_id)
        self.session_id = ""
        if wait:
            self.connection.call("CloseSession", request, timeout_s=timeout_s)
            return
        self.connection.count(request)
        bound = timeout_s or self.bounds.exchange_s()
        self._closing = self.connection.start("CloseSession", request, bound, watched=False)

    def _closed(self) -> None:
        """Wait for a close sent without waiting, however it ended (within its bound): the next session should not
        find the server's store still holding this one's place."""
        if self._closing is not None:
            with contextlib.suppress(grpc.RpcError, grpc.FutureCancelledError, grpc.FutureTimeoutError):
                self._closing.result(timeout=self.bounds.exchange_s() + GRACE_S)
            self._closing = None

    def shutdown(self, timeout_s: float = SHUTDOWN_JOIN_S) -> None:
        """Close the connection for good (``Connection.shutdown``), after a close sent without waiting."""
        self._closed()
        self.connection.shutdown(timeout_s)
