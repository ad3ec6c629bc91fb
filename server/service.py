"""The gRPC service: validates every request, then runs the shared target engine.

Every forward goes through one batcher (``server.batching``), which runs the steps of all waiting
calls together. Each session has its own lock, so a slow or bad request on one session never
corrupts another. Validation happens before any cache is touched, so a rejected
request leaves its session exactly as it was.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc
import torch

from server import payloads
from server.batching import Batcher, ShuttingDown
from server.budget import TreeBudget
from server.limits import ServerLimits
from server.observability import SERVICE, Metrics, add_health_and_reflection, log_session, set_serving
from server.refusals import MAX_DETAILS, Abort, shown
from server.security import TokenAuth, caller
from server.sessions import Session, SessionStore, StoreFull
from server.stretch import Stretches, held_tokens
from shared.acceptance import TYPICAL_DELTA, TYPICAL_EPSILON, SamplingParams
from shared.bundles import SHIPPED
from shared.channel import MAX_MESSAGE_BYTES, MESSAGE_OPTIONS
from shared.engine.prefixes import PrefixCache
from shared.engine.target import INITIAL_CAPACITY, Target, Verdict
from shared.errors import SplitspecError
from shared.payload import PayloadSpec, feature_kinds
from shared.tree import DraftTree, validate_tree
from shared.wire import splitspec_pb2 as pb
from shared.wire import splitspec_pb2_grpc as pb_grpc

PROTOCOL_VERSION = 1
SPARE_WORKERS = 8
LIMITS_SENT = set(pb.Limits.DESCRIPTOR.fields_by_name)  # the limits a client is told, by the same field names
PREFER = ("auto", "latency", "capacity")
LOCK_WAIT_S = 2.0  # a call waits this long for its session's previous call to end (a Decode stream just cancelled)
KV_SHARE = 0.9  # of a GPU's free memory, the most the sessions' KV caches may hold (see ``attach``)
PREFIX_SHARE = 0.25  # of the host memory available at start, the most the prefix cache may hold (see ``attach``)
CHAIN_WAIT_S = 30.0  # the most a chained Verify that overtook the round it follows waits for that round
log = logging.getLogger("splitspec.server")


@dataclass(frozen=True)
class Undecodable:
    """A request body that did not parse as the method's message (what the tolerant parser hands the handler)."""

    message: str
    size: int


def tolerant(message_class):
    """The request parser: a body that does not parse becomes ``Undecodable`` (refused INVALID_ARGUMENT by ``rpc``)
    instead of gRPC's INTERNAL "Exception deserializing request!" and an ERROR traceback in the log."""

    def parse(data: bytes):
        try:
            return message_class.FromString(data)
        except Exception:  # noqa: BLE001 - protobuf's DecodeError, or worse on garbage
            return Undecodable(message_class.__name__, len(data))

    return parse


def add_service(service, server: grpc.Server) -> None:
    """Register the SplitSpec methods, as the generated ``add_SplitSpecServicer_to_server`` does, with ``tolerant``
    request parsers."""
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["SplitSpec"].methods:
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        reply = getattr(pb, method.output_type.name)
        handlers[method.name] = make(getattr(service, method.name),
                                     request_deserializer=tolerant(getattr(pb, method.input_type.name)),
                                     response_serializer=reply.SerializeToString)  # fmt: skip
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


@contextlib.contextmanager
def statuses(service: SplitSpecService, name: str, context: grpc.ServicerContext) -> Iterator[None]:
    """End call ``name`` with a status when what runs inside fails: an Abort's own; anything else (a bug, not bad
    input) INTERNAL, logged — the server keeps serving."""
    try:
        yield
    except Abort as exc:
        service.metrics.refusals.labels(name, exc.code.name).inc()
        exc.send(context)
    except ShuttingDown as exc:  # a client retries elsewhere or later, as for any server going away
        context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
    except Exception as exc:
        log.exception("%s failed", name)
        context.abort(grpc.StatusCode.INTERNAL, f"{name} failed: {exc.__class__.__name__}: {exc}"[:MAX_DETAILS])


def rpc(method: Callable) -> Callable:
    """Every RPC's wrapper: Abort becomes its gRPC status and any unexpected error INTERNAL (``statuses``), never a
    dead server. A server-streaming method returns a generator, which runs after the method has returned: its
    iteration is wrapped too, so a failure mid-stream ends the call the same way."""
    name = method.__name__

    def replies(self, stream, context):
        with statuses(self, name, context):
            yield from stream

    @functools.wraps(method)
    def wrapper(self, request, context):
        with statuses(self, name, context):
            if isinstance(request, Undecodable):
                raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"the request body ({request.size} bytes) is not a {request.message} message")  # fmt: skip
            if self.target is None:
                raise Abort(grpc.StatusCode.UNAVAILABLE, "the server is loading its model; retry shortly", retry_s=1.0)
            reply = method(self, request, context)
            return replies(self, reply, context) if inspect.isgenerator(reply) else reply

    return wrapper


def device_free_bytes(device: torch.device) -> int | None:
    """Bytes free on an accelerator (None on a CPU, whose budget is ``--kv-memory-mb`` alone)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return None


def host_free_bytes() -> int | None:
    """Host memory available to new allocations (Linux's MemAvailable; None where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def checked_sampling(msg: pb.Sampling) -> SamplingParams:
    """A request's sampling, or INVALID_ARGUMENT naming what is wrong with it."""
    temperature, top_p = msg.temperature, msg.top_p or 1.0
    if not (math.isfinite(temperature) and temperature >= 0):
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"temperature {temperature} must be a finite number >= 0")
    if not 0 < top_p <= 1:
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"top_p {top_p} must be in (0, 1]")
    try:
        return SamplingParams(temperature=temperature, top_p=top_p, seed=msg.seed,
                              acceptance=msg.acceptance or "exact", epsilon=msg.epsilon or TYPICAL_EPSILON,
                              delta=msg.delta or TYPICAL_DELTA)  # fmt: skip
    except ValueError as exc:
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling: {exc}") from None

def checked_prompt(ids, vocab_size: int, max_context: int) -> list[int]:
    """A request's prompt, or INVALID_ARGUMENT: empty, a token outside the vocabulary, or no room to generate."""
    ids = list(ids)
    if not ids:
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "empty prompt: expected at least one token id")
    bad = next((t for t in ids if t >= vocab_size), None)
    if bad is not None:
        raise Abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})",
        )
    if len(ids) >= max_context:
        raise Abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"prompt of {len(ids)} tokens exceeds the context limit of {max_context} "
            "(the prompt plus one generated token must fit)",
        )
    return ids


def checked_from(payload_from: int, prompt_ids) -> None:
    """An opening's ``payload_from``: within its prompt, or INVALID_ARGUMENT."""
    if payload_from > len(prompt_ids):
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"payload_from {payload_from} is past the prompt's "
                    f"{len(prompt_ids)} tokens: expected at most that many")  # fmt: skip


def checked_spec(msg: pb.PayloadSpec, target: Target, lsas: payloads.LSARegistry, session=None) -> PayloadSpec:
    """A request's payload spec, or INVALID_ARGUMENT (malformed) / FAILED_PRECONDITION (not served here)."""
    try:
        spec = PayloadSpec.from_msg(msg)
        if spec:
            has_hidden = "hidden" in feature_kinds(spec) if session is None else session.hidden is not None
            payloads.check_spec(spec, target, lsas, has_hidden)
    except ValueError as exc:
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"payload: {exc}") from None
    except payloads.Unavailable as exc:
        raise Abort(grpc.StatusCode.FAILED_PRECONDITION, f"payload: {exc}") from None
    return spec


def assumption_holds(session, request, context) -> bool:
    """Whether the session holds what chained ``request`` assumes: ``length`` tokens, then its ``assumed`` ones. A
    request that overtook the round it follows (the last Verify followed fewer tokens) first waits for that round;
    one the session has moved past is answered at once."""
    sequence, end = session.sequence, request.length + len(request.assumed)
    give_up = time.monotonic() + CHAIN_WAIT_S
    while (session.verified is None or session.verified[0] < request.length) and context.is_active() and \
            time.monotonic() < give_up:  # fmt: skip
        session.changed.wait(min(1.0, give_up - time.monotonic()))
    return session.verified == (request.length, end) and sequence.tokens[request.length :] == list(request.assumed)


class SplitSpecService(pb_grpc.SplitSpecServicer):
    """The SplitSpec API over one target. Built before the model is loaded (every call is then UNAVAILABLE and
    health says NOT_SERVING), it serves once ``attach`` has given it the target."""

    def __init__(self, target: Target | None, limits: ServerLimits = ServerLimits(), bundle_dirs=(SHIPPED,),
                 prefer: str = "auto"):  # fmt: skip
        """``prefer``: what the replies tell clients to spend (``Load.prefer``): ``latency`` (decode for them),
        ``capacity`` (have them draft), or ``auto``: capacity while forwards are compute-bound."""
        if prefer not in PREFER:
            raise ValueError(f"prefer must be one of {', '.join(PREFER)}, got {prefer!r}")
        self.prefer = prefer
        self.target = None
        self.bundle_dirs = bundle_dirs
        capped = {
            "max_probe_bytes": min(limits.max_probe_bytes, MAX_MESSAGE_BYTES - 1024),  # a reply must fit one message
            "max_inline_payload_bytes": min(limits.max_inline_payload_bytes, MAX_MESSAGE_BYTES // 2),
        }
        self.limits = ServerLimits(**{**limits.as_dict(), **capped})
        self.sessions = SessionStore(self.limits.max_sessions, self.limits.session_ttl_s,
                                     self.limits.kv_memory_mb * 2**20, self.limits.evict_idle_s,
                                     on_end=self._ended)  # fmt: skip
        self.prefixes = PrefixCache(self.limits.prefix_cache_mb * 2**20)  # finished sequences' KV, for their next turn
        self.batcher: Batcher | None = None  # runs every forward, once the target is attached
        self.metrics = Metrics(self.sessions, lambda: self.batcher.waiting if self.batcher else 0, self.prefixes)
        self.health = None  # the gRPC health servicer, set by build_server
        self.auth: TokenAuth | None = None  # bearer tokens, when the server runs with them
        self.stretches = Stretches(self)  # what the server decodes by itself
        if target is not None:
            self.attach(target)

    def attach(self, target: Target) -> None:
        """Serve ``target`` from now on (health: SERVING). On a GPU the KV budget is at most what the device has free
        once the target is loaded (``KV_SHARE`` of it: forwards need room too)."""
        self.lsas = payloads.LSARegistry(target, self.bundle_dirs)
        self.limits = ServerLimits(**{**self.limits.as_dict(), "max_context": min(self.limits.max_context,
                                                                                  target.max_context)})  # fmt: skip
        self.kv_bytes_per_token = target.engine.new_cache(1).nbytes
        free = device_free_bytes(target.engine.device)
        if free is not None and int(free * KV_SHARE) < self.sessions.max_bytes:
            self.sessions.max_bytes = int(free * KV_SHARE)
            log.info("KV budget %.0f MiB: %.0f%% of the %.0f MiB free on %s (--kv-memory-mb %d)",
                     self.sessions.max_bytes / 2**20, 100 * KV_SHARE, free / 2**20, target.engine.device,
                     self.limits.kv_memory_mb)  # fmt: skip
        host = host_free_bytes()
        if self.prefixes.max_bytes and host is not None and int(host * PREFIX_SHARE) < self.prefixes.max_bytes:
            self.prefixes.max_bytes = int(host * PREFIX_SHARE)
            log.info("prefix cache %.0f MiB: %.0f%% of the %.0f MiB of host memory available (--prefix-cache-mb %d)",
                     self.prefixes.max_bytes / 2**20, 100 * PREFIX_SHARE, host / 2**20,
                     self.limits.prefix_cache_mb)  # fmt: skip
        if not target.rows_independent and self.prefixes.max_bytes:
            log.info("prefix cache off: on this path (%s) a row's rounding depends on the rows beside it, so a reused "
                     "prefix would not be what a cold prefill computes", target.describe())  # fmt: skip
            self.prefixes.max_bytes = 0
        lim = self.limits
        budget = TreeBudget(lim.min_tree_nodes, prior=target.costs)  # the path timing's costs until its own fit
        self.batcher = Batcher(target.engine, lim.max_batch, lim.max_batch_tokens, lim.batch_window_ms / 1000,
                               on_batch=self.metrics.forward, budget=budget)  # fmt: skip
        self.target = target
        if self.health is not None:
            set_serving(self.health)

    def _ended(self, session, reason: str) -> None:
        """A session ends: logged, and (unless it failed, or a call still holds it) kept in the prefix cache."""
        log_session(session, reason)
        if reason != "failed" and self.prefixes.max_bytes and session.lock.acquire(blocking=False):
            try:
                self.prefixes.keep(session.owner, session.sequence, session.hidden)
            finally:
                session.lock.release()
        if self.batcher is not None:
            self.batcher.forget(session.sequence.cache)

    def close(self) -> None:
        """Stop the session reaper and the batcher (the gRPC server is stopped by its owner)."""
        self.sessions.close()
        if self.batcher is not None:
            self.batcher.close()

    def payload(self, session, spec: PayloadSpec, start: int, end: int) -> pb.Payload:
        """Inline when it fits ``max_inline_payload_bytes``, else only the range, marked pending."""
        if not spec:
            return pb.Payload(start=start, count=0)
        per_token = payloads.raw_bytes_per_token(spec, self.target)
        if (end - start) * per_token // 2 > self.limits.max_inline_payload_bytes:  # fp16 at the very least
            return pb.Payload(start=start, count=end - start, pending=True)
        msg = payloads.export(session, spec, self.lsas, start, end)
        if msg.ByteSize() > self.limits.max_inline_payload_bytes:
            return pb.Payload(start=start, count=end - start, pending=True)
        self.metrics.payload_bytes.inc(msg.ByteSize())
        session.stats.payload_bytes += msg.ByteSize()
        return msg

    def _session(self, session_id: str, context):
        session = self.sessions.get(session_id, caller(context, self.auth))
        if session is None:
            raise Abort(grpc.StatusCode.NOT_FOUND, f"unknown or closed session {shown(session_id)}")
        return session

    def runner(self, context):
        """Runs a call's steps through the batcher while its client is still there: a cancelled call (deadline
        past, client gone) stops at its next step — a long prompt's remaining pieces are never computed — and
        its place is released at once."""

        def run(step):
            if not context.is_active():
                raise Abort(grpc.StatusCode.CANCELLED, "the client cancelled the call or its deadline passed")
            return self.batcher.run(step)

        return run

    def lock(self, session, wait_s: float = LOCK_WAIT_S) -> None:
        """Take the session's lock, waiting briefly for a call just ending (ABORTED if another holds it on); a chained
        Verify waits longer, for the round before it to be verified."""
        if not session.acquire(wait_s):
            raise Abort(grpc.StatusCode.ABORTED, f"session {session.id} is busy with another request")

    def costs(self, context_len: int) -> tuple[float, float] | None:
        """(a forward's fixed seconds, per session sharing it; the seconds each of its tokens adds) at
        ``context_len``: from the forwards served, before there are enough the path timing's (the budget's prior);
        None if neither."""
        batcher = self.batcher
        costs = batcher.budget.costs(context_len) if batcher.budget is not None else self.target.costs
        return None if costs is None else (costs[0] / max(1, batcher.sessions), costs[1])

    def load(self, context_len: int) -> pb.Load:
        """What this server's compute costs now, for a sequence of ``context_len`` tokens (see ``pb.Load``)."""
        batcher = self.batcher
        sessions = max(1, batcher.sessions)
        step, node = self.costs(context_len) or (0.0, 0.0)
        busy = sessions > 1 and batcher.budget is not None and batcher.budget.compute_bound()  # shared and saturated
        prefer = self.prefer if self.prefer != "auto" else "capacity" if busy else "latency"
        return pb.Load(sessions=sessions, step_s=step, node_s=node, prefer=prefer)

    @contextlib.contextmanager
    def place(self, prompt_len: int):
        """Hold a place in the store for a sequence starting with ``prompt_len`` tokens (RESOURCE_EXHAUSTED if none)."""
        capacity = max(INITIAL_CAPACITY, 1 << prompt_len.bit_length())  # what its cache grows to for the prompt
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(self.sessions.hold(capacity * self.kv_bytes_per_token))
            except StoreFull as exc:
                raise Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), retry_s=exc.retry_s) from None
            yield

    # --- RPCs --------------------------------------------------------------------------------

    @rpc
    def Handshake(self, request, context):
        t = self.target
        if request.tokenizer_fingerprint and request.tokenizer_fingerprint != t.fingerprint:
            raise Abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"tokenizer fingerprint {shown(request.tokenizer_fingerprint)} does not match the server's "
                f"{t.fingerprint} (model {t.name}); the client must use this target's tokenizer",
            )
        if request.drafter:
            try:
                self.lsas.load(request.drafter, request.drafter_digest)
            except ValueError as exc:
                raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
            except SplitspecError as exc:
                raise Abort(grpc.StatusCode.FAILED_PRECONDITION, f"drafter {shown(request.drafter)}: {exc}") from None
        return pb.HandshakeReply(
            protocol_version=PROTOCOL_VERSION,
            model_name=t.name,
            tokenizer_fingerprint=t.fingerprint,
            vocab_size=t.vocab_size,
            num_layers=t.num_layers,
            hidden_size=t.hidden_size,
            num_kv_heads=t.num_kv_heads,
            head_dim=t.head_dim,
            eos_token_ids=t.eos_token_ids,
            limits=pb.Limits(**{k: v for k, v in self.limits.as_dict().items() if k in LIMITS_SENT},
                             chained_verify=True),  # fmt: skip
            device=str(t.device),
            dtype=str(t.dtype).removeprefix("torch."),
            drafter=request.drafter,
        )

    @rpc
    def OpenSession(self, request, context):
        start = time.perf_counter()
        spec = checked_spec(request.payload, self.target, self.lsas)
        checked_from(request.payload_from, request.prompt_ids)
        session, first = self.open_session(request.prompt_ids, request.sampling, spec, context)
        with session.lock:
            payload = self.payload(session, spec, request.payload_from, session.sequence.cached_len)
        return pb.OpenSessionReply(session_id=session.id, first_token=first, length=len(session.sequence.tokens),
                                   compute_s=time.perf_counter() - start, payload=payload,
                                   load=self.load(len(session.sequence.tokens)),
                                   reused_tokens=session.stats.reused_tokens)  # fmt: skip

    def open_session(self, prompt_ids, sampling_msg: pb.Sampling, spec: PayloadSpec, context) -> tuple[Session, int]:
        """A new session with ``prompt_ids`` prefilled (OpenSession, or a Decode that opens its session): the
        session and the first token."""
        prompt = checked_prompt(prompt_ids, self.target.vocab_size, self.limits.max_context)
        sampling = checked_sampling(sampling_msg)
        with self.place(len(prompt)):
            start = time.perf_counter()
            hidden, owner = "hidden" in feature_kinds(spec), caller(context, self.auth)
            sequence = self.target.session(sampling, feature_kinds={"hidden"} if hidden else ())
            live = self.sessions.idle(owner) if self.prefixes.max_bytes else ()
            reuse = self.prefixes.take(owner, prompt, hidden, live)
            if reuse:
                sequence.reuse(reuse.k, reuse.v)
            verdict = sequence.prefill(prompt, self.limits.prefill_chunk, self.runner(context))
            session = self.sessions.add(sequence, owner)
            session.stats.prompt_tokens, session.stats.reused_tokens = len(prompt), reuse.length if reuse else 0
            if hidden:
                new = verdict.features.hidden
                session.hidden = torch.cat([reuse.hidden.to(new.device), new]) if reuse else new
        self.metrics.tokens_generated.inc()
        log.info("session %s opened: %d prompt tokens, prefill %.3fs", session.id[:8], len(prompt),
                 time.perf_counter() - start)  # fmt: skip
        return session, verdict.bonus

    @rpc
    def Verify(self, request, context):
        arrived = time.perf_counter()
        session = self._session(request.session_id, context)
        tokens, parents = list(request.tokens), list(request.parents)
        try:
            validate_tree(tokens, parents, self.target.vocab_size, self.limits.max_tree_nodes)
        except ValueError as exc:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        spec = checked_spec(request.payload, self.target, self.lsas, session)
        if request.assumed and not request.length:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "a chained Verify (assumed tokens) needs the length they "
                        "follow, got length 0")  # fmt: skip
        self.lock(session, CHAIN_WAIT_S if request.assumed else LOCK_WAIT_S)
        handed = False  # the lock passed to a thread that decodes on for a client that left (``Stretches.decode_on``)
        try:
            sequence = session.sequence
            if request.assumed and not assumption_holds(session, request, context):
                self.metrics.chained_stale.inc()
                return pb.VerifyReply(stale=True, length=len(sequence.tokens), load=self.load(len(sequence.tokens)))
            held = held_tokens(session, request.length + len(request.assumed) if request.length else 0)
            base = len(sequence.tokens) - len(held)  # the client's length: what the tree follows
            if base + len(tokens) + 1 > self.limits.max_context:  # + the bonus token
                raise Abort(
                    grpc.StatusCode.OUT_OF_RANGE,
                    f"{base} tokens plus a tree of {len(tokens)} exceed the context limit of {self.limits.max_context}",
                )
            start, before = time.perf_counter(), sequence.cached_len - len(held)
            try:
                verdict, computed = self._judge(session, DraftTree(tokens, parents), held, context)
                session.verified = (base, base + len(verdict.new_tokens))
                payload = self.payload(session, spec, before, before + len(verdict.new_tokens))
            except Exception:
                self.sessions.pop(session.id, reason="failed")  # its cache may be half-written: never serve it again
                raise
            handed = not context.is_active() and self.stretches.decode_on(session)
        finally:
            if not handed:
                session.release()
        m, st = self.metrics, session.stats
        m.tokens_verified.inc(computed)
        m.tree_nodes_cut.inc(len(tokens) - verdict.verified_nodes)
        m.tokens_accepted.inc(len(verdict.accepted))
        m.tokens_generated.inc(len(verdict.new_tokens))
        m.verify_seconds.observe(time.perf_counter() - arrived)
        st.rounds, st.nodes = st.rounds + 1, st.nodes + computed
        st.accepted += len(verdict.accepted)
        st.verify_s += time.perf_counter() - start
        return pb.VerifyReply(accepted=verdict.accepted, bonus_token=verdict.bonus,
                              length=base + len(verdict.new_tokens), compute_s=time.perf_counter() - start,
                              payload=payload, verified=verdict.verified_nodes,
                              load=self.load(len(sequence.tokens)))  # fmt: skip

    def _judge(self, session, tree: DraftTree, held: list[int], context) -> tuple[Verdict, int]:
        """``tree`` verified after the client's length, ``held`` being the tokens the session already holds past it
        (decoded for a stream whose client left, or a reply the client lost): they are the target's own choices, so
        the nodes that spell them are accepted with no forward, and the first held token they miss is the bonus —
        the session keeps every held token. Only a path that goes past them all has the rest of its subtree
        verified. Returns the verdict and how many nodes a forward verified."""
        path = tree.follow(held)
        if len(path) < len(held):
            return Verdict(path, [tree.tokens[i] for i in path] + [held[len(path)]], verified_nodes=len(tree)), 0
        rest = tree.subtree(path[-1]) if path else tree  # (no held tokens, the usual round: the tree as it came)
        verdict = session.sequence.verify(rest, self.runner(context))
        session.keep_hidden(verdict)
        cut = verdict.verified_nodes if verdict.verified_nodes is not None else len(rest)
        if not path:
            return verdict, cut
        nodes = tree.descendants(path[-1])
        verified = nodes[cut] if cut < len(nodes) else len(tree)  # the first node not verified, by its index here
        accepted = path + [nodes[i] for i in verdict.accepted]
        return Verdict(accepted, [tree.tokens[i] for i in path] + verdict.new_tokens, verdict.compute_s,
                       verdict.features, verified), cut

    @rpc
    def FetchPayload(self, request, context):
        """Stream features of cached tokens [start, end) in chunks that each fit the inline limit."""
        session = self._session(request.session_id, context)
        spec = checked_spec(request.spec, self.target, self.lsas, session)
        if not spec:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "payload: FetchPayload needs a spec with a mode")
        cached = session.sequence.cached_len
        if not 0 <= request.start < request.end <= cached:
            raise Abort(
                grpc.StatusCode.OUT_OF_RANGE,
                f"payload range [{request.start}, {request.end}) is not within the {cached} cached tokens",
            )
        chunk = max(1, 2 * self.limits.max_inline_payload_bytes // payloads.raw_bytes_per_token(spec, self.target))
        return payloads.fetched(session, spec, self.lsas, request.start, request.end, chunk, context, self.lock)

    @rpc
    def CloseSession(self, request, context):
        session = self.sessions.pop(request.session_id, caller(context, self.auth))
        if session is None:
            raise Abort(grpc.StatusCode.NOT_FOUND, f"unknown or closed session {shown(request.session_id)}")
        return pb.CloseSessionReply(length=len(session.sequence.tokens))

    @rpc
    def Complete(self, request, context):
        """The API baseline: the server decodes alone and streams, as a completion API answers."""
        prompt = checked_prompt(request.prompt_ids, self.target.vocab_size, self.limits.max_context)
        sampling = checked_sampling(request.sampling)
        budget = request.max_new_tokens
        if not 0 < budget <= self.limits.max_new_tokens:
            raise Abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"max_new_tokens {budget} must be in [1, {self.limits.max_new_tokens}]",
            )
        budget = min(budget, self.limits.max_context - len(prompt))
        stop = set(request.stop_token_ids) or set(self.target.eos_token_ids)
        return self.stretches.api(prompt, sampling, budget, stop, context)

    Generate = Complete  # its name before the rename, kept for older clients (the proto's deprecated Generate)

    @rpc
    def Decode(self, request, context):
        """A stretch the server decodes by itself (see the proto): validated here, streamed by ``Stretches.stream``
        (which opens the session first when the request carries a prompt)."""
        if request.prompt_ids and (request.session_id or request.length):
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "a Decode that opens its session (prompt_ids) takes no "
                        f"session_id or length, got {shown(request.session_id)} and {request.length}")  # fmt: skip
        session = None if request.prompt_ids else self._session(request.session_id, context)
        if not 0 < request.max_new_tokens <= self.limits.max_new_tokens:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"max_new_tokens {request.max_new_tokens} must be in "
                        f"[1, {self.limits.max_new_tokens}]")  # fmt: skip
        bad = next((t for t in request.stop_token_ids if t >= self.target.vocab_size), None)
        if bad is not None:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"stop token id {bad} is outside the vocabulary [0, {self.target.vocab_size})")  # fmt: skip
        spec = checked_spec(request.payload, self.target, self.lsas, session)
        checked_from(request.payload_from, request.prompt_ids)
        stop = set(request.stop_token_ids) or set(self.target.eos_token_ids)
        return self.stretches.stream(session, request, spec, stop, context)

    @rpc
    def Probe(self, request, context):
        """Link measurement: the upload is already counted by arriving; answer with reply_bytes zero bytes."""
        if request.reply_bytes > self.limits.max_probe_bytes:
            raise Abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"reply_bytes {request.reply_bytes} exceeds the probe limit of {self.limits.max_probe_bytes} bytes",
            )
        start = time.perf_counter()
        payload = bytes(request.reply_bytes)
        return pb.ProbeReply(payload=payload, compute_s=time.perf_counter() - start)

def build_server(target: Target | None, host: str, port: int, limits: ServerLimits = ServerLimits(),
                 bundle_dirs=(SHIPPED,), credentials: grpc.ServerCredentials | None = None,
                 tokens: dict[str, str] | None = None, prefer: str = "auto"):  # fmt: skip
    """Create (not start) a gRPC server for ``target`` (None: not loaded yet, see ``SplitSpecService.attach``),
    with the health and reflection services; ``credentials``: TLS (``server.security.server_credentials``);
    ``tokens``: {token: identity} a caller must present one of. Returns (server, bound port, service)."""
    service = SplitSpecService(None, limits, bundle_dirs, prefer)
    service.auth = TokenAuth(tokens) if tokens else None
    options = MESSAGE_OPTIONS
    # every session or stream may block one worker (waiting for the model); the spare ones keep Handshake,
    # Probe, health checks and OpenSession answering whatever the sessions do
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=limits.max_sessions + SPARE_WORKERS), options=options,
                         interceptors=[service.auth] if service.auth else [])  # fmt: skip
    add_service(service, server)
    service.health = add_health_and_reflection(server)
    where = f"{host}:{port}"
    bound = server.add_secure_port(where, credentials) if credentials else server.add_insecure_port(where)
    if bound == 0:
        raise OSError(f"could not listen on {host}:{port} (in use or not a local address?)")
    if target is not None:
        service.attach(target)
    return server, bound, service
