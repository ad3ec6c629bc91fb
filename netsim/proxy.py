"""The data plane: one asyncio TCP proxy per Toxiproxy proxy, a toxic chain per direction.

A :class:`Proxy` listens and, per accepted client, dials the upstream and runs a :class:`Link`:
two :class:`Pipe` objects, ``upstream`` (client -> server) and ``downstream`` (server -> client).
Each pipe reads chunks as fast as they come (stamping their arrival, so latency is counted from
there), queues them, and pushes each through the toxics of its stream in order. Toxics changed
through the API apply to live connections at once, as in Toxiproxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
import time

from netsim.toxics import ApiError, Chunk, CloseLink, Toxic

READ_BYTES = 256 * 1024  # per socket read; large reads keep the untoxic path fast
QUEUE_CHUNKS = 64  # chunks waiting in one direction before the proxy stops reading (backpressure)
CONNECT_TIMEOUT_S = 10.0


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` -> (host, port); an empty host means loopback (netsim never listens wider unasked)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ApiError(400, f"address must be HOST:PORT, got {address!r}")
    return (host.strip("[]") or "127.0.0.1"), int(port)


class Pipe:
    """One direction of one connection: reader -> queue -> toxics -> writer."""

    def __init__(self, link: Link, stream: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.link, self.stream = link, stream
        self.reader, self.writer = reader, writer
        self.queue: asyncio.Queue[Chunk | None] = asyncio.Queue(QUEUE_CHUNKS)
        self.stages: dict[str, tuple[Toxic, object, bool]] = {}  # name -> (toxic, state, active here)
        self.sync()

    def sync(self) -> None:
        """Match this pipe's stages to the proxy's toxics; toxicity is drawn once per connection."""
        current = [t for t in self.link.proxy.toxics.values() if t.stream == self.stream]
        for name, (toxic, state, _) in list(self.stages.items()):
            if all(t is not toxic for t in current):
                toxic.drop_state(state)
                del self.stages[name]
        stages = {}
        for toxic in current:
            if toxic.name in self.stages:
                stages[toxic.name] = self.stages[toxic.name]
            else:
                active = random.random() < toxic.toxicity
                stages[toxic.name] = (toxic, toxic.new_state(self.link.close) if active else None, active)
        self.stages = stages

    def drop(self) -> None:
        for toxic, state, active in self.stages.values():
            if active:
                toxic.drop_state(state)
        self.stages = {}

    async def read(self) -> None:
        try:
            while data := await self.reader.read(READ_BYTES):
                await self.queue.put(Chunk(data, time.monotonic()))
        except (ConnectionError, OSError):
            pass
        await self.queue.put(None)

    async def run(self) -> None:
        reading = asyncio.create_task(self.read())
        try:
            while (chunk := await self.queue.get()) is not None:
                active = [(t, s) for t, s, on in self.stages.values() if on]
                async for piece in _through(chunk, active):
                    self.writer.write(piece.data)
                    await self.writer.drain()
            for toxic, state, on in list(self.stages.values()):
                if on:
                    await toxic.at_eof(state)
            if self.writer.can_write_eof() and not self.writer.is_closing():
                self.writer.write_eof()
        finally:
            reading.cancel()


async def _through(chunk: Chunk, stages: list[tuple[Toxic, object]]):
    """Push one chunk through the toxic chain; each stage may split, delay or drop it."""
    if not stages:
        yield chunk
        return
    (toxic, state), rest = stages[0], stages[1:]
    async for piece in toxic.pipe(chunk, state):
        async for out in _through(piece, rest):
            yield out


class Link:
    """A client connection and its upstream connection, joined by two pipes."""

    def __init__(self, proxy: Proxy, client: tuple[asyncio.StreamReader, asyncio.StreamWriter]):
        self.proxy = proxy
        self.client = client
        self.upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self.pipes: list[Pipe] = []
        self.tasks: list[asyncio.Task] = []

    async def run(self) -> None:
        host, port = split_address(self.proxy.upstream)
        try:
            self.upstream = await asyncio.wait_for(
                asyncio.open_connection(host, port, limit=2 * READ_BYTES), CONNECT_TIMEOUT_S
            )
        except (TimeoutError, OSError):
            self.close()  # upstream down: the client sees a clean close, as Toxiproxy does
            return
        for writer in (self.client[1], self.upstream[1]):
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.pipes = [
            Pipe(self, "upstream", self.client[0], self.upstream[1]),
            Pipe(self, "downstream", self.upstream[0], self.client[1]),
        ]
        self.tasks = [asyncio.create_task(p.run()) for p in self.pipes]
        try:
            await asyncio.gather(*self.tasks)
        except CloseLink as exc:
            self.close(exc.reset)
        except (ConnectionError, OSError, asyncio.CancelledError):
            pass
        finally:
            self.close()

    def sync(self) -> None:
        for pipe in self.pipes:
            pipe.sync()

    def close(self, reset: bool = False) -> None:
        """End both connections now; ``reset`` makes the client see "connection reset by peer"."""
        for task in self.tasks:
            task.cancel()
        for pipe in self.pipes:
            pipe.drop()
        for _, writer in filter(None, (self.client, self.upstream)):
            if reset:
                sock = writer.get_extra_info("socket")
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
            else:
                writer.close()
        self.proxy.links.discard(self)


class Proxy:
    """One named proxy: its listener, its toxics (in the order added) and its live links."""

    def __init__(self, name: str, listen: str, upstream: str):
        self.name, self.listen, self.upstream = name, listen or "127.0.0.1:0", upstream
        self.enabled = False
        self.toxics: dict[str, Toxic] = {}
        self.links: set[Link] = set()
        self.server: asyncio.Server | None = None

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "listen": self.listen,
            "upstream": self.upstream,
            "enabled": self.enabled,
            "toxics": [t.to_json() for t in self.toxics.values()],
        }

    async def start(self) -> None:
        if self.enabled:
            return
        host, port = split_address(self.listen)
        split_address(self.upstream)  # refuse a malformed upstream before listening
        try:
            self.server = await asyncio.start_server(self._accept, host, port, limit=2 * READ_BYTES)
        except OSError as exc:  # Toxiproxy answers a failed listen with 500 and the OS's words
            raise ApiError(500, f"listen tcp {self.listen}: {exc.strerror or exc}") from None
        sockname = self.server.sockets[0].getsockname()
        self.listen = f"{host}:{sockname[1]}"
        self.enabled = True

    def stop(self) -> None:
        """Stop listening and cut every live connection (``enabled: false``)."""
        if self.server is not None:
            self.server.close()
            self.server = None
        for link in list(self.links):
            link.close()
        self.enabled = False

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = Link(self, (reader, writer))
        self.links.add(link)
        await link.run()

    def set_toxic(self, toxic: Toxic) -> None:
        self.toxics[toxic.name] = toxic
        for link in list(self.links):
            link.sync()

    def remove_toxic(self, name: str) -> None:
        del self.toxics[name]
        for link in list(self.links):
            link.sync()
