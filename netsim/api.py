"""Toxiproxy 2.x's HTTP API, served by Starlette on uvicorn next to the proxies it controls.

Routes, JSON shapes, defaults and status codes follow Toxiproxy (``api.go``): proxies are
created with 201, toxics with 200, deletes and ``/reset`` answer 204, errors are
``{"error": message, "status": code}`` with 400 (bad input), 404 (unknown proxy, toxic or route),
405 (wrong method), 409 (name taken), 413 (a body over MAX_BODY_BYTES) and 500 (the OS refused to
listen). Where Toxiproxy accepts nonsense silently (negative times, unknown attributes) netsim
answers 400 and says what was wrong.

The HTTP layer is Starlette on uvicorn, the stack the edge's OpenAI-compatible endpoint uses: one
HTTP stack in the project, and a well-kept parser (keep-alive, chunked bodies, malformed requests)
instead of our own. uvicorn runs inside the caller's event loop, the proxies' loop, so the API and
the data plane still share state without locks.
"""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from netsim.proxy import Proxy
from netsim.toxics import EXTENSIONS, ApiError, make_toxic

VERSION = "2.12.0"  # the Toxiproxy API version netsim follows
SERVER_NAME = "splitspec-netsim"
MAX_BODY_BYTES = 1 << 20

Reply = tuple[int, Any]  # a route's answer: (status, JSON-able body or None)


def _json_body(body: bytes) -> Any:
    try:
        return json.loads(body or b"null")
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"bad request body: {exc}") from None


async def _read_body(request: Request) -> bytes:
    """The body, refused with 413 before reading past MAX_BODY_BYTES (whether a Content-Length or chunked)."""
    too_big = ApiError(413, f"request body exceeds {MAX_BODY_BYTES} bytes")
    if int(request.headers.get("content-length", 0)) > MAX_BODY_BYTES:
        raise too_big
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise too_big
    return bytes(body)


def _reply(status: int, payload: Any, headers: Mapping[str, str] | None = None) -> Response:
    """Toxiproxy's answer: one line of JSON, or no body at all (204)."""
    if payload is None:
        return Response(status_code=status, headers=headers)
    return Response(json.dumps(payload) + "\n", status, headers, media_type="application/json")


def _error(status: int, message: str, headers: Mapping[str, str] | None = None) -> Response:
    return _reply(status, {"error": message, "status": status}, headers)


def _field(obj: dict, key: str, kind: type, default: Any) -> Any:
    value = obj.get(key, default)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ApiError(400, f"bad request body: {key!r} must be a {kind.__name__}, got {value!r}")
    return value


class Collection:
    """The proxies by name and the operations the routes perform on them."""

    def __init__(self) -> None:
        self.proxies: dict[str, Proxy] = {}

    def get(self, name: str) -> Proxy:
        if name not in self.proxies:
            raise ApiError(404, f"proxy not found: {name!r}")
        return self.proxies[name]

    @staticmethod
    def _proxy_input(body: Any, where: str = "") -> tuple[str, str, str, bool]:
        if not isinstance(body, dict):
            raise ApiError(400, f"bad request body: expected a JSON object{where}, got {type(body).__name__}")
        name = _field(body, "name", str, "")
        upstream = _field(body, "upstream", str, "")
        if not name:
            raise ApiError(400, f"missing required field: name{where}")
        if not upstream:
            raise ApiError(400, f"missing required field: upstream{where}")
        return name, _field(body, "listen", str, ""), upstream, _field(body, "enabled", bool, True)

    async def create(self, body: Any) -> Proxy:
        name, listen, upstream, enabled = self._proxy_input(body)
        if name in self.proxies:
            raise ApiError(409, f"proxy already exists: {name!r}")
        proxy = Proxy(name, listen, upstream)
        if enabled:
            await proxy.start()
        self.proxies[name] = proxy
        return proxy

    async def populate(self, body: Any) -> tuple[list[Proxy], ApiError | None]:
        """Create or replace many proxies; all are validated before any is touched."""
        if isinstance(body, dict) and isinstance(body.get("proxies"), list):
            body = body["proxies"]
        if not isinstance(body, list):
            raise ApiError(400, f"bad request body: expected a JSON array of proxies, got {type(body).__name__}")
        inputs = [self._proxy_input(p, f" at proxy {i + 1}") for i, p in enumerate(body)]
        done: list[Proxy] = []
        for name, listen, upstream, enabled in inputs:
            old = self.proxies.get(name)
            if old is not None and old.listen == (listen or old.listen) and old.upstream == upstream:
                done.append(old)
                continue
            if old is not None:
                old.stop()
                del self.proxies[name]
            try:
                proxy = Proxy(name, listen, upstream)
                if enabled:
                    await proxy.start()
            except ApiError as exc:
                return done, exc
            self.proxies[name] = proxy
            done.append(proxy)
        return done, None

    async def update(self, proxy: Proxy, body: Any) -> Proxy:
        if not isinstance(body, dict):
            raise ApiError(400, f"bad request body: expected a JSON object, got {type(body).__name__}")
        if _field(body, "name", str, proxy.name) != proxy.name:
            raise ApiError(400, f"a proxy's name cannot change ({proxy.name!r}); delete and re-create it")
        listen = _field(body, "listen", str, proxy.listen) or proxy.listen
        upstream = _field(body, "upstream", str, proxy.upstream) or proxy.upstream
        enabled = _field(body, "enabled", bool, proxy.enabled)
        if (listen, upstream) != (proxy.listen, proxy.upstream):
            proxy.stop()
            proxy.listen, proxy.upstream = listen, upstream
        if enabled and not proxy.enabled:
            await proxy.start()
        elif not enabled:
            proxy.stop()
        return proxy

    def delete(self, name: str) -> None:
        self.get(name).stop()
        del self.proxies[name]

    async def reset(self) -> None:
        """Enable every proxy and remove every toxic."""
        for proxy in self.proxies.values():
            for name in list(proxy.toxics):
                proxy.remove_toxic(name)
            await proxy.start()

    def stop_all(self) -> None:
        for proxy in self.proxies.values():
            proxy.stop()


class ApiServer:
    """The HTTP front of a :class:`Collection`: an ASGI application."""

    ROUTES = {
        "/reset": {"POST": "reset"},
        "/version": {"GET": "version"},
        "/populate": {"POST": "populate"},
        "/proxies": {"GET": "proxy_index", "POST": "proxy_create"},
        "/proxies/{name}": {"GET": "proxy_show", "POST": "proxy_update", "PATCH": "proxy_update",
                            "DELETE": "proxy_delete"},
        "/proxies/{name}/toxics": {"GET": "toxic_index", "POST": "toxic_create"},
        "/proxies/{name}/toxics/{toxic_name}": {"GET": "toxic_show", "POST": "toxic_update",
                                                "PATCH": "toxic_update", "DELETE": "toxic_delete"},
    }  # fmt: skip

    def __init__(self, collection: Collection | None = None):
        self.collection = collection or Collection()
        routes = [Route(path, self._endpoint(methods), methods=list(methods)) for path, methods in self.ROUTES.items()]
        self.app = Starlette(routes=routes, exception_handlers={404: self._no_route, 405: self._no_method})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """ASGI entry; a trailing slash is ignored (``/proxies/`` is ``/proxies``), never redirected."""
        if scope["type"] == "http":
            scope = {**scope, "path": scope["path"].rstrip("/") or "/"}
        await self.app(scope, receive, send)

    def _endpoint(self, methods: dict[str, str]) -> Callable[[Request], Awaitable[Response]]:
        """One path's endpoint, the route picked by method; every outcome, a bug included, answers JSON."""

        async def endpoint(request: Request) -> Response:
            route = getattr(self, methods["GET" if request.method == "HEAD" else request.method])  # Starlette adds HEAD
            try:
                return _reply(*await route(await _read_body(request), **request.path_params))
            except ApiError as exc:  # after a 413 the unread body goes with the connection
                return _error(exc.status, exc.message, {"connection": "close"} if exc.status == 413 else None)
            except Exception as exc:  # a bug must not take the API down: report it and go on
                return _error(500, f"internal error: {type(exc).__name__}: {exc}")

        return endpoint

    async def _no_route(self, request: Request, exc: HTTPException) -> Response:
        return _error(404, f"no such endpoint: {request.url.path}")

    async def _no_method(self, request: Request, exc: HTTPException) -> Response:
        """Starlette's 405, which names the allowed methods in its Allow header, in Toxiproxy's shape."""
        where = f"{request.method} not allowed on {request.url.path}"
        return _error(405, f"method {where} (allowed: {exc.headers['Allow']})", exc.headers)

    # --- routes: each takes the raw body (and the path's names) and returns (status, body) ---

    async def reset(self, body: bytes) -> Reply:
        await self.collection.reset()
        return 204, None

    async def version(self, body: bytes) -> Reply:
        return 200, {"version": VERSION, "server": SERVER_NAME, "extensions": sorted(EXTENSIONS)}

    async def populate(self, body: bytes) -> Reply:
        proxies, error = await self.collection.populate(_json_body(body))
        listed = [p.to_json() for p in proxies]
        if error is not None:
            return error.status, {"error": error.message, "status": error.status, "proxies": listed}
        return 201, {"proxies": listed}

    async def proxy_index(self, body: bytes) -> Reply:
        return 200, {name: p.to_json() for name, p in self.collection.proxies.items()}

    async def proxy_create(self, body: bytes) -> Reply:
        return 201, (await self.collection.create(_json_body(body))).to_json()

    async def proxy_show(self, body: bytes, name: str) -> Reply:
        return 200, self.collection.get(name).to_json()

    async def proxy_update(self, body: bytes, name: str) -> Reply:
        proxy = self.collection.get(name)
        return 200, (await self.collection.update(proxy, _json_body(body))).to_json()

    async def proxy_delete(self, body: bytes, name: str) -> Reply:
        self.collection.delete(name)
        return 204, None

    async def toxic_index(self, body: bytes, name: str) -> Reply:
        return 200, [t.to_json() for t in self.collection.get(name).toxics.values()]

    async def toxic_create(self, body: bytes, name: str) -> Reply:
        proxy = self.collection.get(name)
        toxic = make_toxic(_json_body(body))
        if toxic.name in proxy.toxics:
            raise ApiError(409, f"toxic already exists: {toxic.name!r} on proxy {name!r}")
        proxy.set_toxic(toxic)
        return 200, toxic.to_json()

    def _toxic(self, name: str, toxic_name: str) -> tuple[Proxy, Any]:
        proxy = self.collection.get(name)
        if toxic_name not in proxy.toxics:
            raise ApiError(404, f"toxic not found: {toxic_name!r} on proxy {name!r}")
        return proxy, proxy.toxics[toxic_name]

    async def toxic_show(self, body: bytes, name: str, toxic_name: str) -> Reply:
        return 200, self._toxic(name, toxic_name)[1].to_json()

    async def toxic_update(self, body: bytes, name: str, toxic_name: str) -> Reply:
        proxy, old = self._toxic(name, toxic_name)
        toxic = make_toxic(_json_body(body), previous=old)
        proxy.set_toxic(toxic)
        return 200, toxic.to_json()

    async def toxic_delete(self, body: bytes, name: str, toxic_name: str) -> Reply:
        self._toxic(name, toxic_name)[0].remove_toxic(toxic_name)
        return 204, None


class _EmbeddedServer(uvicorn.Server):
    """uvicorn on the caller's event loop; signals stay the caller's (``netsim serve`` cancels on SIGINT/SIGTERM)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve(host: str, port: int, ready: Callable[[str], None] | None = None) -> None:
    """Run the API (and the proxies it creates) until cancelled; ``ready(url)`` once listening.

    The socket is bound here, not by uvicorn: port 0 gets a free port to report, and a port in use
    raises OSError (uvicorn would exit the process).
    """
    api = ApiServer()
    sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    config = uvicorn.Config(api, log_level="warning", access_log=False, lifespan="off", server_header=False,
                            headers=[("server", f"{SERVER_NAME}/{VERSION}")])  # fmt: skip
    server = _EmbeddedServer(config)
    if ready is not None:
        ready(f"http://{host}:{sock.getsockname()[1]}")
    try:
        await server.serve(sockets=[sock])
    finally:
        if server.started:  # cancelled: close the listener and the API's connections, then the proxies
            await server.shutdown(sockets=[sock])
        sock.close()
        api.collection.stop_all()
