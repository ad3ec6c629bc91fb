"""A small client for the Toxiproxy HTTP API: netsim's own server or a real ``toxiproxy-server``.

It is what netsim's profiles, CLI and Python harness speak; tests also drive the server with
the independent ``toxiproxy-python`` package to prove compatibility.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from shared.errors import SplitspecError

DEFAULT_URL = "http://127.0.0.1:8474"


class ToxiproxyError(SplitspecError):
    """The API answered an error; ``status`` is its HTTP code (0: not reachable)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class ToxiproxyClient:
    def __init__(self, url: str = DEFAULT_URL, timeout_s: float = 10.0):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def request(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        req.add_header("User-Agent", "splitspec-netsim")  # Toxiproxy refuses browser user agents
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as reply:
                raw = reply.read()
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                message = json.loads(raw)["error"]
            except (ValueError, KeyError, TypeError):
                message = raw.decode(errors="replace").strip() or exc.reason
            raise ToxiproxyError(exc.code, f"toxiproxy {method} {path}: {exc.code}: {message}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ToxiproxyError(0, f"no Toxiproxy API at {self.url} ({reason})") from None
        return json.loads(raw) if raw.strip() else None

    def version(self) -> dict:
        """``{"version": ...}``; netsim adds ``"server"`` and ``"extensions"`` (the toxics only it has)."""
        reply = self.request("GET", "/version")
        return reply if isinstance(reply, dict) else {"version": str(reply)}

    def alive(self) -> bool:
        try:
            self.version()
            return True
        except ToxiproxyError:
            return False

    def extensions(self) -> set[str]:
        return set(self.version().get("extensions", []))

    def proxies(self) -> dict[str, dict]:
        return self.request("GET", "/proxies")

    def proxy(self, name: str) -> dict:
        return self.request("GET", f"/proxies/{name}")

    def create(self, name: str, upstream: str, listen: str = "127.0.0.1:0", enabled: bool = True) -> dict:
        body = {"name": name, "upstream": upstream, "listen": listen, "enabled": enabled}
        return self.request("POST", "/proxies", body)

    def update(self, name: str, **fields: Any) -> dict:
        return self.request("POST", f"/proxies/{name}", fields)

    def delete(self, name: str) -> None:
        self.request("DELETE", f"/proxies/{name}")

    def toxics(self, name: str) -> list[dict]:
        return self.request("GET", f"/proxies/{name}/toxics")

    def add_toxic(self, proxy: str, type: str, stream: str = "downstream", toxicity: float = 1.0,
                  name: str | None = None, **attributes: Any) -> dict:  # fmt: skip
        body = {"type": type, "stream": stream, "toxicity": toxicity, "attributes": attributes}
        if name:
            body["name"] = name
        return self.request("POST", f"/proxies/{proxy}/toxics", body)

    def remove_toxic(self, proxy: str, toxic: str) -> None:
        self.request("DELETE", f"/proxies/{proxy}/toxics/{toxic}")

    def reset(self) -> None:
        self.request("POST", "/reset")
