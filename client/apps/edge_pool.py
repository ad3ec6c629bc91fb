"""What answers the edge's requests (``client.apps.edge`` is the HTTP side): the drafters and server connections pooled
across requests (``Edge``), one generation on a worker thread of its own whose text the event loop awaits
(``Job``), the server's health as /health tells it (``ServerHealth``), and the edge's metrics (``Counters``).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from client.apps.openai_request import Ask, RequestError, completion_exceeded, context_exceeded
from client.apps.text import Delta, TextDeltas
from shared.engine.models import DEFAULT_MODEL

IDLE_MB = 512  # what idle clients' drafters may hold for the conversations they go on from (``Edge.release``)
DEFAULT_MAX_TOKENS = 256  # a request that sets no max_tokens gets what fits its context, at most this many
# an idle connection kept longer is closed, not reused: one silent for long may have died unnoticed (a NAT's
# timeout, a switch of network), and the first call on it would wait out its whole deadline
KEEP_IDLE_S = 60.0
HEALTH_EVERY_S = 1.0  # while /health is asked, the server's health is checked this often
HEALTH_TIMEOUT_S = 1.0  # one check's deadline: a server that does not answer within it is not serving
HEALTH_IDLE_S = 60.0  # the checks stop once /health has not been asked for this long


class Cancelled(Exception):
    """The app went away: its generation stops at the next update."""


class Counters:
    """The edge's Prometheus metrics (prometheus-client), one registry per endpoint."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        self.requests = Counter("splitspec_edge_requests", "requests by route and status", ["route", "status"],
                                registry=r)  # fmt: skip
        self.active = Gauge("splitspec_edge_active_generations", "generations running now", registry=r)
        self.tokens = Counter("splitspec_edge_tokens", "tokens generated", registry=r)
        self.offline_tokens = Counter("splitspec_edge_offline_tokens", "tokens generated while the link was down",
                                      registry=r)  # fmt: skip
        self.server_calls = Counter("splitspec_edge_server_calls", "calls to the server", registry=r)
        self.disconnects = Counter("splitspec_edge_disconnects", "times a generation lost the link", registry=r)
        self.seconds = Histogram("splitspec_edge_generation_seconds", "a generation's wall time", registry=r)


class ServerHealth:
    """Whether the server's standard health service says SERVING, for the edge's /health: checked on a thread and a
    connection of their own, so that /health answers from the latest check at once, whatever the server and the
    generations are doing. (Asked on /health's own path, the check waited for a new connection's handshake and for a
    server busy with every stream's prefill, up to its whole deadline, and more on a machine the streams kept busy.)

    Checks run only while /health is asked (within ``idle_s``): an edge nobody watches sends nothing, and the first
    /health after a pause waits for a fresh check. ``clock``: what that decision reads (injectable for tests)."""

    def __init__(self, endpoint, every_s: float = HEALTH_EVERY_S, timeout_s: float = HEALTH_TIMEOUT_S,
                 idle_s: float = HEALTH_IDLE_S, clock: Callable[[], float] = time.monotonic):  # fmt: skip
        self.endpoint, self.every_s, self.timeout_s, self.idle_s = endpoint, every_s, timeout_s, idle_s
        self.clock = clock
        self.checks = 0  # checks answered or failed
        self._lock = threading.Lock()  # guards what follows; never held across a check
        self._latest: Future = Future()  # (serving, when) of the latest check; pending until the first since a pause
        self._asked = clock()
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None

    def latest(self) -> Future:
        """/health is asked: (serving, when on ``clock``) of the latest check, a future still pending before the first
        one; the checks start (again)."""
        with self._lock:
            self._asked = self.clock()
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._run, daemon=True, name="splitspec-edge-health")
                self._thread.start()
            self._wake.set()
            return self._latest

    async def serving(self) -> tuple[bool, float | None]:
        """On the event loop: (serving, seconds since that check) of the latest check, at once; before the first one,
        that one (its deadline bounds it; the wait here is only a net for a check gRPC never ends: (False, None))."""
        latest = self.latest()
        if not latest.done():  # (shielded: a wait that times out must not cancel the future other requests share)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(latest)), 2 * self.timeout_s)
        if not latest.done():
            return False, None
        serving, when = latest.result(timeout=0)  # (done: no wait)
        return serving, self.clock() - when

    def close(self) -> None:
        """Stop checking (a check under way ends within its deadline, on its daemon thread)."""
        with self._lock:
            self._stop.set()
            self._wake.set()

    def _run(self) -> None:
        from grpc_health.v1 import health_pb2_grpc

        from shared.channel import RECONNECT_OPTIONS, close_soon

        channel = self.endpoint.channel([("grpc.use_local_subchannel_pool", 1), *RECONNECT_OPTIONS])
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            while not self._stop.is_set():
                with self._lock:
                    idle = self.clock() - self._asked >= self.idle_s
                    if idle:
                        self._wake.clear()  # (``latest`` sets it under this lock: no wake-up is lost)
                        if self._latest.done():
                            self._latest = Future()  # stale: the next /health waits for a fresh check
                if idle:  # asleep until asked (looking again now and then: no wait without a bound)
                    self._wake.wait(max(self.idle_s, 1.0))
                    continue
                serving = self._check(stub)
                with self._lock:
                    if self._latest.done():
                        self._latest = Future()
                    self._latest.set_result((serving, self.clock()))
                    self.checks += 1
                self._stop.wait(self.every_s)
        finally:
            close_soon(channel)

    def _check(self, stub) -> bool:
        import grpc
        from grpc_health.v1 import health_pb2

        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=self.timeout_s)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING


class Edge:
    """The tokenizer and the way to the server, shared by every request, and a pool of clients
    (``client.build.Client``: a drafter, a connection, what its policy learnt), one per concurrent generation, kept
    for the next."""

    def __init__(self, server: str, drafter: str | Callable[[], object] = "prompt-lookup", model: str = DEFAULT_MODEL,
                 on_reconnect: str = "verify", endpoint=None, dtype: str = "auto", cache: str | None = None,
                 connect_timeout_s: float = 10.0, max_tree_nodes: int | None = None, mode: str = "auto",
                 idle_mb: int = IDLE_MB):  # fmt: skip
        """``drafter``: a drafter's name (``client.drafters.make_drafter``) or a function making one; ``mode``: the
        adaptive policy's (``client.loop.adaptive``); ``idle_mb``: what the idle clients' drafters may hold for the
        conversations they go on from (the ones idle longest are closed beyond it)."""
        from client.build import ClientOptions, Shared
        from client.net.endpoint import Endpoint

        self.stopping = threading.Event()  # SIGTERM/SIGINT: every generation ends now, wherever it is
        self.server, self.model = server, model
        self.endpoint = endpoint or Endpoint(server)
        self.options = ClientOptions(model=model, cache_dir=cache, endpoint=self.endpoint,
                                     connect_timeout_s=connect_timeout_s,
                                     drafter=drafter if isinstance(drafter, str) else "none",
                                     on_reconnect=on_reconnect, max_tree_nodes=max_tree_nodes, mode=mode,
                                     dtype=dtype)  # fmt: skip
        self.shared = Shared.load(self.options)
        self.tokenizer = self.shared.tokenizer
        self._make_drafter = None if isinstance(drafter, str) else drafter
        self._idle: list[tuple[object, float]] = []  # (Client, time.monotonic() it went idle)
        self.idle_bytes = idle_mb * 2**20
        self._lock = threading.Lock()
        self.counters = Counters()
        self.health = ServerHealth(self.endpoint)
        first = self.take()  # a bad drafter name fails now, not at the first request
        self.drafter_name = first.drafter.name
        self.resilience = first.resilience  # every client's is alike
        self.release(first)

    def take(self, prompt_ids: list[int] = ()):
        """An idle client, else a new one: the one whose last generation ``prompt_ids`` goes on from the furthest (a
        conversation's next turn: its drafter holds the conversation's state), else the one idle the shortest. A
        connection idle for ``KEEP_IDLE_S`` or more is closed, not reused."""
        from client.build import Client
        from shared.lookup import shared_length

        with self._lock:
            best = max(range(len(self._idle)), key=lambda i: (shared_length(self._idle[i][0].history, prompt_ids), i),
                       default=None)  # fmt: skip
            client, since = self._idle.pop(best) if best is not None else (None, 0.0)
        if client is None:
            drafter = self._make_drafter() if self._make_drafter else None
            return Client(self.options, self.shared, drafter, stopping=self.stopping)
        if time.monotonic() - since >= KEEP_IDLE_S:
            client.disconnect()
        return client

    def release(self, client) -> None:
        """Back to the pool; the clients idle longest are closed while the idle ones hold more than ``idle_bytes``
        (one always stays)."""
        closing = []
        with self._lock:
            self._idle.append((client, time.monotonic()))
            while len(self._idle) > 1 and sum(c.drafter.held_bytes() for c, _ in self._idle if c.drafter) > \
                    self.idle_bytes:  # fmt: skip
                closing.append(self._idle.pop(0)[0])
        for old in closing:
            old.close()

    def close(self) -> None:
        """Close the idle clients' connections (generations running keep theirs until they end); stop the health
        checks."""
        self.health.close()
        with self._lock:
            idle, self._idle = self._idle, []
        for client, _ in idle:
            client.close()

    def prompt_ids(self, ask: Ask) -> tuple[list[int], object]:
        """The prompt's token ids, private spans replaced by placeholders (``client.apps.private``), and their
        secrets."""
        from client.apps.private import Secrets, mask, mask_messages
        from shared.engine.models import encode_messages

        if ask.chat:
            messages, secrets = mask_messages(ask.prompt)
            return encode_messages(self.tokenizer, messages), secrets
        if isinstance(ask.prompt, list):  # token ids: no text to mask
            size = len(self.tokenizer)
            bad = next((t for t in ask.prompt if t >= size), None)
            if bad is not None:
                raise RequestError(400, f"prompt token id {bad} is outside the tokenizer's vocabulary [0, {size})",
                                   "prompt")  # fmt: skip
            return list(ask.prompt), Secrets()
        text, secrets = mask(ask.prompt)
        return self.tokenizer(text)["input_ids"], secrets

    def generate(self, ask: Ask, prompt_ids: list[int], on_update: Callable[[list[int], list[bool]], None],
                 stop_when: Callable[[], bool], on_start: Callable[[], None] = lambda: None):  # fmt: skip
        """One generation through the decode loop, on this thread; returns the ``Generation``. ``on_start()``: the
        server is reached and the prompt fits its context (else a RequestError), the generation begins.

        The connection goes back to the pool unless the generation failed, was cancelled or lost the link: then it
        is closed, and the next request opens a new one."""
        from shared.acceptance import SamplingParams

        sampling = SamplingParams(temperature=ask.temperature, top_p=ask.top_p, seed=ask.seed,
                                  acceptance=ask.acceptance)  # fmt: skip
        client = self.take(prompt_ids)
        c = self.counters
        c.active.inc()
        start = time.perf_counter()
        works = False
        try:
            verifier = client.verifier
            if len(prompt_ids) >= verifier.max_context:
                works = True  # the prompt is wrong, not the connection
                raise context_exceeded(len(prompt_ids), verifier.max_context, "messages" if ask.chat else "prompt")
            room = verifier.max_context - len(prompt_ids)
            if ask.max_tokens is not None and ask.max_tokens > room:
                works = True
                raise completion_exceeded(len(prompt_ids), ask.max_tokens, verifier.max_context, ask.chat)
            max_new = ask.max_tokens if ask.max_tokens is not None else min(DEFAULT_MAX_TOKENS, room)
            on_start()
            gen = client.generate(prompt_ids, max_new, on_update,
                                  lambda tokens, verified: stop_when() or self.stopping.is_set(), sampling)
            works = gen.stats.disconnects == 0
        finally:
            if not works:
                client.disconnect()
            self.release(client)
            c.active.dec()
        s = gen.stats
        c.tokens.inc(s.new_tokens)
        c.offline_tokens.inc(s.offline_tokens)
        c.server_calls.inc(s.server_calls)
        c.disconnects.inc(s.disconnects)
        c.seconds.observe(time.perf_counter() - start)
        return gen


class Job:
    """One generation on a worker thread of its own, its text handed to the event loop as ``Delta``s
    (``client.apps.text``) with ``call_soon_threadsafe``: a request waiting for text holds no thread (a thread of the
    loop's executor per stream starved every other request, /health included, once streams outnumbered them)."""

    def __init__(self, edge: Edge, ask: Ask):
        self.edge, self.ask = edge, ask
        self.prompt_ids: list[int] = []  # encoded on the worker: a long prompt takes a while
        self.text_deltas: TextDeltas | None = None
        self.text = ""  # the settled text so far
        self._provisional = ""
        self._gen = None
        self._error: BaseException | None = None
        self._cancelled = threading.Event()
        self._loop = asyncio.get_running_loop()
        self._deltas: asyncio.Queue = asyncio.Queue()  # deltas that change something, then None at the end
        self._begun: asyncio.Future = self._loop.create_future()  # True: generating; False: it ended before
        self._thread = threading.Thread(target=self._run, daemon=True, name="splitspec-edge-generation")

    @property
    def stopped(self) -> bool:
        return self.text_deltas is not None and self.text_deltas.stopped

    @property
    def error(self) -> BaseException | None:
        return self._error

    def start(self) -> None:
        self._thread.start()

    def cancel(self) -> None:
        self._cancelled.set()

    def _send(self, call: Callable, *args) -> None:
        """Run ``call(*args)`` on the event loop (from the worker thread); nothing once the loop has closed."""
        with contextlib.suppress(RuntimeError):  # closed: the endpoint stopped, nobody waits
            self._loop.call_soon_threadsafe(call, *args)

    def _begin(self, begun: bool) -> None:
        if not self._begun.done():
            self._begun.set_result(begun)

    def _emit(self, delta: Delta) -> None:
        if delta.settled or delta.events or delta.provisional != self._provisional:
            self.text += delta.settled
            self._provisional = delta.provisional
            self._send(self._deltas.put_nowait, delta)

    def _update(self, tokens: list[int], verified: list[bool]) -> None:
        if self._cancelled.is_set():
            raise Cancelled
        self._emit(self.text_deltas.update(tokens, verified))

    def _run(self) -> None:
        edge, ask = self.edge, self.ask
        try:
            try:
                self.prompt_ids, secrets = edge.prompt_ids(ask)
            except ValueError as exc:  # a malformed private span
                raise RequestError(400, str(exc), "messages" if ask.chat else "prompt") from None
            self.text_deltas = TextDeltas(edge.tokenizer, final_offline=edge.resilience.on_reconnect == "keep",
                                          stop=ask.stop, secrets=secrets)  # fmt: skip
            gen = edge.generate(ask, self.prompt_ids, self._update,
                                stop_when=lambda: self.stopped or self._cancelled.is_set(),
                                on_start=lambda: self._send(self._begin, True))  # fmt: skip
            self._emit(self.text_deltas.update(gen.token_ids, gen.verified, final=True))
            self._gen = gen
        except BaseException as exc:  # noqa: BLE001 - handed to the request that waits for it
            self._error = exc
        finally:
            self._send(self._begin, False)
            self._send(self._deltas.put_nowait, None)

    async def started(self) -> bool:
        """Wait until the generation begins (True) or ends without beginning (False: see ``error``)."""
        return await self._begun

    async def deltas(self):
        """The deltas as they come, awaited on the event loop."""
        while (item := await self._deltas.get()) is not None:
            yield item

    def result(self):
        if self._error is not None:
            raise self._error
        return self._gen
