"""Toxiproxy 2.x's HTTP API, served by asyncio next to the proxies it controls.

Routes, JSON shapes, defaults and status codes follow Toxiproxy (``api.go``): proxies are
created with 201, toxics with 200, deletes and ``/reset`` answer 204, errors are
``{"error": message, "status": code}`` with 400 (bad input), 404 (unknown proxy or toxic), 409
(name taken) and 500 (the OS refused to listen). Where Toxiproxy accepts nonsense silently
(negative times, unknown attributes) netsim answers 400 and says what was wrong.

The HTTP layer is a deliberately small HTTP/1.1 server (Content-Length bodies, keep-alive): the
API carries a few hundred bytes of JSON per call, and staying on the proxies' event loop means
no locks between the API and the data plane.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from netsim.proxy import Proxy
from netsim.toxics import EXTENSIONS, ApiError, make_toxic

VERSION = "2.12.0"  # the Toxiproxy API version netsim follows
SERVER_NAME = "splitspec-netsim"
MAX_BODY_BYTES = 1 << 20
REASONS = {200: "OK", 201: "Created", 204: "No Content", 400: "Bad Request", 404: "Not Found",
           405: "Method Not Allowed", 409: "Conflict", 411: "Length Required", 413: "Payload Too Large",
           500: "Internal Server Error"}  # fmt: skip


def _json_body(body: bytes) -> Any:
    try:
        return json.loads(body or b"null")
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"bad request body: {exc}") from None


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
    """The HTTP front of a :class:`Collection`."""

    ROUTES = [
        (re.compile(r"/reset"), {"POST": "reset"}),
        (re.compile(r"/version"), {"GET": "version"}),
        (re.compile(r"/populate"), {"POST": "populate"}),
        (re.compile(r"/proxies"), {"GET": "proxy_index", "POST": "proxy_create"}),
        (re.compile(r"/proxies/([^/]+)"),
         {"GET": "proxy_show", "POST": "proxy_update", "PATCH": "proxy_update", "DELETE": "proxy_delete"}),
        (re.compile(r"/proxies/([^/]+)/toxics"), {"GET": "toxic_index", "POST": "toxic_create"}),
        (re.compile(r"/proxies/([^/]+)/toxics/([^/]+)"),
         {"GET": "toxic_show", "POST": "toxic_update", "PATCH": "toxic_update", "DELETE": "toxic_delete"}),
    ]  # fmt: skip

    def __init__(self, collection: Collection | None = None):
        self.collection = collection or Collection()

    # --- routes: each returns (status, JSON-able body or None) ---

    async def reset(self, body):
        await self.collection.reset()
        return 204, None

    async def version(self, body):
        return 200, {"version": VERSION, "server": SERVER_NAME, "extensions": sorted(EXTENSIONS)}

    async def populate(self, body):
        proxies, error = await self.collection.populate(_json_body(body))
        listed = [p.to_json() for p in proxies]
        if error is not None:
            return error.status, {"error": error.message, "status": error.status, "proxies": listed}
        return 201, {"proxies": listed}

    async def proxy_index(self, body):
        return 200, {name: p.to_json() for name, p in self.collection.proxies.items()}

    async def proxy_create(self, body):
        return 201, (await self.collection.create(_json_body(body))).to_json()

    async def proxy_show(self, body, name):
        return 200, self.collection.get(name).to_json()

    async def proxy_update(self, body, name):
        proxy = self.collection.get(name)
        return 200, (await self.collection.update(proxy, _json_body(body))).to_json()

    async def proxy_delete(self, body, name):
        self.collection.delete(name)
        return 204, None

    async def toxic_index(self, body, name):
        return 200, [t.to_json() for t in self.collection.get(name).toxics.values()]

    async def toxic_create(self, body, name):
        proxy = self.collection.get(name)
        toxic = make_toxic(_json_body(body))
        if toxic.name in proxy.toxics:
            raise ApiError(409, f"toxic already exists: {toxic.name!r} on proxy {name!r}")
        proxy.set_toxic(toxic)
        return 200, toxic.to_json()

    def _toxic(self, name: str, toxic_name: str):
        proxy = self.collection.get(name)
        if toxic_name not in proxy.toxics:
            raise ApiError(404, f"toxic not found: {toxic_name!r} on proxy {name!r}")
        return proxy, proxy.toxics[toxic_name]

    async def toxic_show(self, body, name, toxic_name):
        return 200, self._toxic(name, toxic_name)[1].to_json()

    async def toxic_update(self, body, name, toxic_name):
        proxy, old = self._toxic(name, toxic_name)
        toxic = make_toxic(_json_body(body), previous=old)
        proxy.set_toxic(toxic)
        return 200, toxic.to_json()

    async def toxic_delete(self, body, name, toxic_name):
        self._toxic(name, toxic_name)[0].remove_toxic(toxic_name)
        return 204, None

    # --- HTTP ---

    async def dispatch(self, method: str, path: str, body: bytes) -> tuple[int, Any]:
        path = path.split("?", 1)[0].rstrip("/") or "/"
        for pattern, methods in self.ROUTES:
            match = pattern.fullmatch(path)
            if match:
                if method not in methods:
                    raise ApiError(405, f"method {method} not allowed on {path} (allowed: {', '.join(methods)})")
                return await getattr(self, methods[method])(body, *match.groups())
        raise ApiError(404, f"no such endpoint: {path}")

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve one keep-alive HTTP/1.1 connection; an error answers, never escapes."""
        try:
            while True:
                request_line = await reader.readline()
                if not request_line.strip():
                    break
                parts = request_line.decode("latin-1").split()
                headers: dict[str, str] = {}
                while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    key, _, value = line.decode("latin-1").partition(":")
                    headers[key.strip().lower()] = value.strip()
                keep_alive = headers.get("connection", "").lower() != "close"
                try:
                    if len(parts) != 3:
                        raise ApiError(400, f"malformed request line: {request_line[:80]!r}")
                    if "chunked" in headers.get("transfer-encoding", "").lower():
                        raise ApiError(411, "send the body with a Content-Length (chunked bodies are not supported)")
                    length = int(headers.get("content-length", "0") or 0)
                    if not 0 <= length <= MAX_BODY_BYTES:
                        raise ApiError(413, f"body of {length} bytes exceeds {MAX_BODY_BYTES}")
                    body = await reader.readexactly(length) if length else b""
                    status, payload = await self.dispatch(parts[0].upper(), parts[1], body)
                except ApiError as exc:
                    status, payload = exc.status, {"error": exc.message, "status": exc.status}
                    if exc.status in (411, 413) or len(parts) != 3:  # the body was not read: start afresh
                        keep_alive = False
                except ValueError:
                    status, payload = 400, {"error": "bad Content-Length header", "status": 400}
                    keep_alive = False
                except Exception as exc:  # a bug must not take the API down: report it and go on
                    status, payload = 500, {"error": f"internal error: {type(exc).__name__}: {exc}", "status": 500}
                data = b"" if payload is None else json.dumps(payload).encode() + b"\n"
                head = [f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}", f"Content-Length: {len(data)}",
                        f"Server: {SERVER_NAME}/{VERSION}", f"Connection: {'keep-alive' if keep_alive else 'close'}"]
                if data:
                    head.append("Content-Type: application/json")
                writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + data)
                await writer.drain()
                if not keep_alive:
                    break
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            pass
        finally:
            writer.close()


async def serve(host: str, port: int, ready=None) -> None:
    """Run the API (and the proxies it creates) until cancelled; ``ready(url)`` once listening."""
    api = ApiServer()
    server = await asyncio.start_server(api.handle, host, port)
    bound = server.sockets[0].getsockname()
    if ready is not None:
        ready(f"http://{host}:{bound[1]}")
    try:
        async with server:
            await server.serve_forever()
    finally:
        api.collection.stop_all()
