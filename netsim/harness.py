"""The Python API for tests and benchmarks: find or start a Toxiproxy API, put a shaped link in
front of a server, clean up.

``Netsim.connect()`` looks, in order, for ``$TOXIPROXY_URL``, an API already answering on
127.0.0.1:8474, a ``toxiproxy-server`` on PATH (started on a free loopback port), and else starts
netsim's own server in a child process (a separate process, so the proxy never competes with
the caller for the GIL). ``simulated_link()`` is the one-liner most callers want::

    with simulated_link("127.0.0.1:50051", "4g") as link:
        client = RemoteVerifier(link.address)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator

from netsim.client import DEFAULT_URL, ToxiproxyClient, ToxiproxyError
from netsim.profiles import Profile, apply_profile, get_profile
from shared.errors import SplitspecError

START_TIMEOUT_S = 15.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Netsim:
    """A Toxiproxy API to drive, and the child process serving it when we started one."""

    def __init__(self, client: ToxiproxyClient, kind: str, process: subprocess.Popen | None = None):
        self.client, self.kind, self.process = client, kind, process

    @classmethod
    def connect(cls, url: str | None = None, spawn: bool = True) -> Netsim:
        url = url or os.environ.get("TOXIPROXY_URL")
        if url:
            client = ToxiproxyClient(url)
            if not client.alive():
                raise SplitspecError(f"no Toxiproxy API answers at {url} (from --url or $TOXIPROXY_URL)")
            return cls(client, "external")
        default = ToxiproxyClient(DEFAULT_URL)
        if default.alive():
            return cls(default, "running")
        if not spawn:
            raise SplitspecError(f"no Toxiproxy API at {DEFAULT_URL}; start one with `splitspec netsim serve`")
        exe = shutil.which("toxiproxy-server")
        if exe:
            port = free_port()
            return cls._start([exe, "-host", "127.0.0.1", "-port", str(port)], "toxiproxy-server", port)
        return cls.start_own()

    @classmethod
    def start_own(cls) -> Netsim:
        """netsim's own API server in a child process on a free loopback port."""
        port = free_port()
        command = [sys.executable, "-m", "netsim", "serve", "--host", "127.0.0.1", "--port", str(port)]
        return cls._start(command, "netsim", port)

    @classmethod
    def _start(cls, command: list[str], kind: str, port: int) -> Netsim:
        url = f"http://127.0.0.1:{port}"
        log = tempfile.TemporaryFile()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        client = ToxiproxyClient(url)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not client.alive():
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                log.seek(0)
                tail = log.read().decode(errors="replace")[-2000:]
                raise SplitspecError(f"{' '.join(command)} did not start serving {url}:\n{tail}")
            time.sleep(0.05)
        return cls(client, kind, process)

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> Netsim:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Flapper:
    """Cuts and restores a proxy on a schedule: up ``period_s - down_s`` seconds, then down ``down_s``."""

    def __init__(self, client: ToxiproxyClient, proxy: str, period_s: float, down_s: float):
        if not 0 < down_s < period_s:
            raise SplitspecError(f"flaky link needs 0 < down ({down_s:g}s) < period ({period_s:g}s)")
        self.client, self.proxy = client, proxy
        self.period_s, self.down_s = period_s, down_s
        self.cuts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"flapper-{proxy}", daemon=True)

    def start(self) -> Flapper:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.period_s - self.down_s):
            self._set(False)
            self.cuts += 1
            if self._stop.wait(self.down_s):
                break
            self._set(True)
        self._set(True)

    def _set(self, enabled: bool) -> None:
        with contextlib.suppress(ToxiproxyError):  # the proxy may be gone already at shutdown
            self.client.update(self.proxy, enabled=enabled)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


SILENT_CUT = {"upstream": "silent-cut-up", "downstream": "silent-cut-down"}


def cut_link(client: ToxiproxyClient, proxy: str, silent: bool = False) -> None:
    """Take ``proxy``'s link down. Loud (default): live connections are closed and new ones refused, as
    when the peer's host is gone. Silent: every byte is dropped both ways and nothing is closed, as when
    a radio link fades — only a deadline or a heartbeat can tell."""
    if silent:
        for stream, name in SILENT_CUT.items():
            client.add_toxic(proxy, "timeout", stream=stream, name=name, timeout=0)
    else:
        client.update(proxy, enabled=False)


def restore_link(client: ToxiproxyClient, proxy: str) -> None:
    """Undo either kind of cut."""
    names = {t["name"] for t in client.toxics(proxy)}
    for name in SILENT_CUT.values():
        if name in names:
            client.remove_toxic(proxy, name)
    client.update(proxy, enabled=True)


class SimulatedLink:
    """A proxy in front of one upstream: connect to ``address`` instead of the upstream."""

    def __init__(self, client: ToxiproxyClient, name: str, address: str, period_s: float, down_s: float):
        self.client, self.name, self.address = client, name, address
        self.period_s, self.down_s = period_s, down_s
        self.profile: Profile | None = None
        self.flapper: Flapper | None = None
        self.closed = False

    def apply(self, profile: Profile | str) -> Profile:
        if self.flapper:
            self.flapper.stop()
            self.flapper = None
        self.profile = apply_profile(self.client, self.name, profile)
        if self.profile.flaky:
            self.flapper = Flapper(self.client, self.name, self.period_s, self.down_s).start()
        return self.profile

    def cut(self, silent: bool = False) -> None:
        """The link goes dead (see ``cut_link``)."""
        cut_link(self.client, self.name, silent)

    def restore(self) -> None:
        """Undo a cut; nothing once the link is closed (a timer may restore a link whose run already ended)."""
        if not self.closed:
            restore_link(self.client, self.name)

    def close(self) -> None:
        self.closed = True
        if self.flapper:
            self.flapper.stop()
        with contextlib.suppress(ToxiproxyError):
            self.client.delete(self.name)


@contextlib.contextmanager
def simulated_link(
    upstream: str,
    profile: Profile | str = "none",
    *,
    netsim: Netsim | None = None,
    name: str | None = None,
    period_s: float = 10.0,
    down_s: float = 2.0,
) -> Iterator[SimulatedLink]:
    """A proxy with ``profile`` in front of ``upstream`` for the duration of the block."""
    get_profile(profile) if isinstance(profile, str) else profile  # a bad name fails before anything starts
    owned = netsim is None
    netsim = netsim or Netsim.connect()
    try:
        name = name or f"splitspec-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        proxy = netsim.client.create(name, upstream)
        link = SimulatedLink(netsim.client, name, proxy["listen"], period_s, down_s)
        try:
            link.apply(profile)
            yield link
        finally:
            link.close()
    finally:
        if owned:
            netsim.close()
