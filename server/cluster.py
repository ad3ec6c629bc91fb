"""`splitspec serve --ray`: the same service as N Ray Serve replicas behind Serve's gRPC proxy.

Each replica is one ``SplitSpecService`` (one model, one batcher, its own sessions); the replicas
share nothing. Clients keep the wire contract of ``protos/`` and talk to Serve's gRPC proxy, which
routes every call by its ``multiplexed_model_id`` metadata — the *route key* a client draws for each
session it opens (``shared.channel.ROUTE_KEY``): the replica that opens a session registers the key
as a multiplexed "model", so Serve's router sends the session's later calls to it. Handshake, Probe,
Complete (the API baseline) and health carry no key and go to any replica.

Affinity is Serve's, best effort: a call whose key no live replica holds (its replica died or was
replaced) lands elsewhere and gets NOT_FOUND at once; the client reopens the session from its
history, as it does after a server restart (lossless). Such calls are counted
(``splitspec_route_misses``).

Serve calls the replica's methods by the RPC's name with the parsed request and Serve's own gRPC
context; ``CallContext`` gives the service what it expects of a context, and the synchronous service
runs on a thread pool so that one call waiting for the batcher never holds up the others.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from server.limits import ServerLimits
from server.service import MAX_DETAILS, SPARE_WORKERS, SplitSpecService
from shared.bundles import SHIPPED
from shared.channel import MAX_MESSAGE_BYTES, PUSHBACK

APP = "splitspec"
SERVICER = "shared.wire.splitspec_pb2_grpc.add_SplitSpecServicer_to_server"
HEALTH_SERVICER = "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server"
METRICS_PUSH_S = 2.0  # how often a replica copies its figures into Ray's metrics


class Refused(Exception):
    """Raised by ``CallContext.abort``: Serve's proxy sends the code and details set on its context."""


class CallContext:
    """What ``SplitSpecService`` asks of a gRPC context, over the one Serve hands a replica: metadata and auth
    context are the caller's; ``abort`` sets the status and raises; ``is_active`` turns False once the call is
    cancelled (the client went away), so a long call stops at its next step as it does in ``splitspec serve``."""

    def __init__(self, context) -> None:
        self.context = context
        self.cancelled = False
        self.trailing: list = []

    def invocation_metadata(self):
        return self.context.invocation_metadata()

    def auth_context(self):
        return self.context.auth_context()

    def is_active(self) -> bool:
        return not self.cancelled

    def set_trailing_metadata(self, metadata) -> None:
        self.trailing = list(metadata)
        self.context.set_trailing_metadata(self.trailing)

    def abort(self, code: grpc.StatusCode, details: str):
        pushback = dict(self.trailing).get(PUSHBACK)
        if pushback is not None:  # Serve's proxy sends an error without trailing metadata: the hint goes in the message
            details = f"{details[: MAX_DETAILS - 40]} [{PUSHBACK}={pushback}]"
        self.context.set_code(code)
        self.context.set_details(details[:MAX_DETAILS])
        raise Refused(details)


@dataclass(frozen=True)
class ReplicaConfig:
    """What every replica loads and how it serves: ``splitspec serve``'s options, passed to each replica."""

    model: str
    device: str = "cpu"
    dtype: str = "auto"
    weights: str = "auto"
    graphs: bool = False  # --cuda-graphs
    cache_dir: str | None = None
    threads: int | None = None
    limits: dict = field(default_factory=lambda: ServerLimits().as_dict())
    bundle_dirs: tuple[str, ...] = (str(SHIPPED),)
    prefer: str = "auto"
    tokens: dict | None = None  # {token: identity}, as --auth-token-file gives


class Replica:
    """One replica of the Serve application (deployed by ``deploy``): Serve calls a method per RPC."""

    def __init__(self, config: ReplicaConfig) -> None:
        import torch
        from ray import serve

        from server.observability import RouteMetrics
        from server.security import TokenAuth
        from shared.engine.models import load_target

        # the session log lines and the service's warnings, in the replica's log file (Ray's logs/serve/ folder)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        if config.threads:
            torch.set_num_threads(config.threads)
        target = load_target(config.model, device=config.device, dtype=config.dtype, cache=config.cache_dir,
                             weights=config.weights, graphs=config.graphs)  # fmt: skip
        limits = ServerLimits(**config.limits)
        self.service = SplitSpecService(target, limits, config.bundle_dirs, config.prefer)
        self.service.auth = TokenAuth(config.tokens) if config.tokens else None
        self.service.lsas.preload()  # a session in payload form lsa may open on a replica the Handshake did not reach
        self.route = RouteMetrics(self.service.metrics.registry)
        # every session or stream may wait on the batcher in a thread of its own; the spare ones keep the rest going
        self.pool = ThreadPoolExecutor(limits.max_sessions + SPARE_WORKERS, thread_name_prefix="splitspec-call")
        self.pid = os.getpid()

        async def hold(key: str) -> str:
            """A route key as Serve's multiplexed "model": loading it is registering it here, so Serve's router
            sends the calls carrying it to this replica (a key already here only takes its LRU place again)."""
            return key

        # a session's route key: at most every session the store may hold, then some
        self.hold = serve.multiplexed(max_num_models_per_replica=2 * limits.max_sessions)(hold)
        self._stop = threading.Event()
        threading.Thread(target=self._push_metrics, daemon=True, name="splitspec-metrics").start()

    # --- routing -----------------------------------------------------------------------------

    async def _opened(self, context) -> None:
        key = context.multiplexed_model_id()
        if key:
            await self.hold(key)

    async def _affine(self, session_id: str, context) -> None:
        """A call on session ``session_id``: keep its route key registered here, or count a miss (the service then
        answers NOT_FOUND: the client reopens the session from its history)."""
        if self.service.sessions.holds(session_id):
            key = context.multiplexed_model_id()
            if key:
                await self.hold(key)
            self.route.hits.inc()
        else:
            self.route.misses.inc()

    # --- calls -------------------------------------------------------------------------------

    def _check(self, context: CallContext) -> None:
        from server.security import UNAUTHENTICATED

        auth = self.service.auth
        if auth is not None and auth.identity(context.invocation_metadata()) is None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED)

    async def _unary(self, name: str, request, grpc_context, session_id: str | None = None):
        """The service's ``name`` on a pool thread; ``session_id``: a call on that session (routing figures)."""
        context = CallContext(grpc_context)
        self._check(context)
        if session_id is not None:
            await self._affine(session_id, grpc_context)
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self.pool, getattr(self.service, name), request, context)
        except asyncio.CancelledError:
            context.cancelled = True
            raise

    async def _stream(self, name: str, request, grpc_context, session_id: str | None = None):
        """The service's reply stream, iterated on one pool thread (a Decode holds its session's lock from its first
        chunk to its last) and handed over through a queue; ``session_id`` as for ``_unary``."""
        context = CallContext(grpc_context)
        self._check(context)
        if session_id is not None:
            await self._affine(session_id, grpc_context)
        loop, queue, end = asyncio.get_running_loop(), asyncio.Queue(), object()

        def pump():
            try:
                for message in getattr(self.service, name)(request, context):
                    loop.call_soon_threadsafe(queue.put_nowait, message)
                    if context.cancelled:
                        break
                loop.call_soon_threadsafe(queue.put_nowait, end)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, which raises it
                loop.call_soon_threadsafe(queue.put_nowait, exc)

        self.pool.submit(pump)
        try:
            while (message := await queue.get()) is not end:
                if isinstance(message, BaseException):
                    raise message
                yield message
        finally:
            context.cancelled = True  # the stream ended early (the client left): the pump stops at its next step

    async def Handshake(self, request, grpc_context):
        return await self._unary("Handshake", request, grpc_context)

    async def Probe(self, request, grpc_context):
        return await self._unary("Probe", request, grpc_context)

    async def OpenSession(self, request, grpc_context):
        reply = await self._unary("OpenSession", request, grpc_context)
        await self._opened(grpc_context)
        return reply

    async def Verify(self, request, grpc_context):
        return await self._unary("Verify", request, grpc_context, request.session_id)

    async def CloseSession(self, request, grpc_context):
        return await self._unary("CloseSession", request, grpc_context, request.session_id)

    async def FetchPayload(self, request, grpc_context):
        async for message in self._stream("FetchPayload", request, grpc_context, request.session_id):
            yield message

    async def Decode(self, request, grpc_context):
        async for chunk in self._stream("Decode", request, grpc_context, request.session_id or None):
            if chunk.session_id:  # the stream opened its session here
                await self._opened(grpc_context)
            yield chunk

    async def Complete(self, request, grpc_context):
        async for chunk in self._stream("Complete", request, grpc_context):
            yield chunk

    Generate = Complete  # the deprecated name of the same call

    async def Check(self, request, grpc_context):
        """grpc.health.v1: a replica that answers has its model loaded (Serve starts routing to it only then)."""
        from grpc_health.v1 import health_pb2

        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    # --- for operators and tests -------------------------------------------------------------

    def figures(self) -> dict:
        """This replica's routing figures and sessions (a deployment handle reaches a chosen replica by sending the
        route key that hashes to it: ``server.routing.owner``)."""
        from ray import serve

        count = self.service.metrics.registry.get_sample_value
        prefixes = self.service.prefixes
        return {"replica": serve.get_replica_context().replica_id.unique_id, "pid": self.pid,
                "sessions": len(self.service.sessions), "hits": int(count("splitspec_route_hits_total")),
                "misses": int(count("splitspec_route_misses_total")), "prefix_on": bool(prefixes.max_bytes),
                "prefix_hit_tokens": prefixes.hit_tokens, "prefix_miss_tokens": prefixes.miss_tokens}  # fmt: skip

    def check_health(self) -> None:
        """Serve's own health check (every few seconds): a replica whose batcher thread died is replaced."""
        if self.service.batcher is None or not self.service.batcher.alive:
            raise RuntimeError("the batcher thread is not running")

    def _push_metrics(self) -> None:
        """Copy this replica's figures into Ray's metrics (``ray.serve.metrics`` tags them with the replica), so one
        scrape of Ray's metrics port has Serve's and every replica's."""
        from server.observability import RayMirror

        mirror = RayMirror(self.service.metrics.registry)
        while not self._stop.wait(METRICS_PUSH_S):
            mirror.push()

    def __del__(self) -> None:
        self._stop.set()
        self.service.close()


ROUTERS = {"session": "server.routing.SessionRouter", "serve": None}  # None: Serve's own (power of two choices)


def deploy(config: ReplicaConfig, replicas: int, port: int, host: str = "127.0.0.1", cpus: float = 0.0,
           gpus: float = 0.0, name: str = APP, router: str = "session"):  # fmt: skip
    """Run the application on the Ray cluster this process is connected to (``ray.init`` first): ``replicas``
    copies of ``Replica`` behind Serve's gRPC proxy on ``host``:``port``, calls routed by ``router`` (``ROUTERS``:
    ``session``, strict affinity, or ``serve``, Serve's best-effort multiplexing). Returns once every replica has
    loaded."""
    from ray import serve
    from ray.serve.config import HTTPOptions, RequestRouterConfig, gRPCOptions

    if router not in ROUTERS:
        raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {router!r}")
    routing = {"request_router_config": RequestRouterConfig(request_router_class=ROUTERS[router])} if ROUTERS[
        router] else {}

    limits = ServerLimits(**config.limits)
    serve.start(
        http_options=HTTPOptions(host=host, port=0),
        grpc_options=gRPCOptions(port=port, grpc_servicer_functions=[SERVICER, HEALTH_SERVICER]),
    )
    deployment = serve.deployment(
        Replica,
        name="Replica",
        num_replicas=replicas,
        # Serve's own queue must never refuse what the service would admit: every session, stream and spare call
        max_ongoing_requests=limits.max_sessions + SPARE_WORKERS,
        ray_actor_options={"num_cpus": cpus, "num_gpus": gpus},
        health_check_period_s=2.0,
        graceful_shutdown_timeout_s=2.0,
        **routing,
    )
    # a route prefix makes it an endpoint of the proxies (gRPC routes by method name; the HTTP one has no use for it)
    serve.run(deployment.bind(config), name=name, route_prefix=f"/{name}")


def replicas(name: str = APP) -> dict[str, str]:
    """The application's replica actors: {Serve's unique replica id: Ray actor name} (a replica being replaced may
    still be listed until it is gone)."""
    import ray

    prefix = f"SERVE_REPLICA::{name}#"
    return {a["name"].rsplit("#", 1)[1]: a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == "serve" and a["name"].startswith(prefix)}  # fmt: skip


def kill(replica_id: str, name: str = APP) -> None:
    """Kill a replica's process outright (``ray.kill``: no shutdown code runs), as a crash or a lost node would;
    Serve starts a replacement."""
    import ray

    ray.kill(ray.get_actor(replicas(name)[replica_id], namespace="serve"))


def figures(name: str = APP) -> list[dict]:
    """Every live replica's ``Replica.figures``, each asked through a deployment handle with a route key the session
    router sends to that replica."""
    from ray import serve

    from server.routing import owner

    handle, ids = serve.get_app_handle(name), list(replicas(name))
    keys = [next(k for k in (f"figures-{i}" for i in range(100 * len(ids))) if owner(k, ids) == rid) for rid in ids]
    return [handle.options(multiplexed_model_id=k).figures.remote().result() for k in keys]


def running(name: str = APP) -> int:
    """How many of the application's replicas are up and serving (Serve's own account)."""
    from ray import serve

    app = serve.status().applications.get(name)
    return sum(d.replica_states.get("RUNNING", 0) for d in app.deployments.values()) if app else 0


def wait_running(count: int, name: str = APP, timeout_s: float = 120.0) -> float:
    """Wait until ``count`` replicas are RUNNING; returns the seconds waited (TimeoutError past ``timeout_s``)."""
    start = time.monotonic()
    while running(name) < count:
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"{running(name)} of {count} replicas running after {timeout_s:g}s")
        time.sleep(0.1)
    return time.monotonic() - start


def ray_environment() -> dict[str, str]:
    """What Serve's processes must see before ``ray.init`` starts them: messages as large as the service's."""
    return {"RAY_SERVE_GRPC_MAX_MESSAGE_SIZE": str(MAX_MESSAGE_BYTES)}


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now (the OS's pick for port 0), for a listener that cannot report its own."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
