"""Toxics: each one a small stage in a pipe, with Toxiproxy's names, attributes and units.

A toxic sees the chunks of one direction of one connection, in order, and yields what goes on
(the same chunk later, smaller pieces, or nothing). It may end the connection by raising
:class:`CloseLink`. Per-connection state (a bandwidth clock, a byte count, a timer) lives in the
object ``new_state`` returns, so one toxic definition serves every connection of its proxy.

Units follow Toxiproxy 2.x: milliseconds for latency, jitter, timeouts and delays; KB/s
(1000 bytes) for bandwidth; bytes for sizes; microseconds for the slicer's delay. ``loss`` is
netsim's own extension (Toxiproxy has no loss toxic); see :class:`Loss`.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, ClassVar

STREAMS = ("upstream", "downstream")


class ApiError(Exception):
    """An error answered to the API client as Toxiproxy does: ``{"error": message, "status": code}``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class CloseLink(Exception):
    """Raised by a toxic to end the whole connection; ``reset`` sends RST instead of FIN."""

    def __init__(self, reset: bool = False):
        super().__init__("reset" if reset else "close")
        self.reset = reset


@dataclass
class Chunk:
    """Bytes plus when they are due at the next stage (time.monotonic()).

    Stages compute delays from ``due``, not from when they got around to the chunk, so a slow
    event loop (a busy CPU) delays data but never adds to the simulated latency or steals rate.
    The proxy sets ``due`` to the moment it read the data.
    """

    data: bytes
    due: float


class Toxic:
    """One toxic as the API knows it; subclasses add ``pipe`` and their attribute table."""

    type: ClassVar[str]
    #: attribute name -> (python type, default); Toxiproxy's JSON names and zero defaults
    fields: ClassVar[dict[str, tuple[type, Any]]]

    def __init__(self, name: str, stream: str, toxicity: float, attributes: dict[str, Any]):
        self.name, self.stream, self.toxicity = name, stream, toxicity
        self.attributes = attributes
        for key, value in attributes.items():
            setattr(self, key, value)

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "type": self.type,
            "stream": self.stream,
            "toxicity": self.toxicity,
            "attributes": dict(self.attributes),
        }

    def check(self) -> None:
        """Cross-attribute rules beyond "a non-negative number"; raise ApiError(400)."""

    def new_state(self, close) -> Any:
        """Per-connection state; ``close(reset)`` ends the connection (for timers)."""
        return None

    def drop_state(self, state: Any) -> None:
        """The toxic left this connection (removed, updated, or the connection closed)."""

    async def pipe(self, chunk: Chunk, state: Any) -> AsyncIterator[Chunk]:
        yield chunk

    async def at_eof(self, state: Any) -> None:
        """The sending side finished; runs before the close is passed on."""


TIMER_SLACK_S = 0.0005  # asyncio sleeps round up to epoll's whole milliseconds: aim half of one early


async def sleep_until(deadline: float) -> None:
    """Sleep until ``deadline`` (time.monotonic()), right on average despite the timers' granularity.

    Wake-ups still run ~0.5 ms late per sleep on this VM (an idle CPU wakes slowly); the
    benchmark reports configured against measured round trips.
    """
    wait = deadline - time.monotonic() - TIMER_SLACK_S
    if wait > 0:
        await asyncio.sleep(wait)


class Latency(Toxic):
    """Adds ``latency`` ± ``jitter`` ms (uniform) to every chunk, counted from when it is due here.

    One deviation from Toxiproxy, which draws the jitter per chunk: a chunk that arrives while
    the previous one is still held (a burst) shares its draw. In-order delivery makes a chunk
    wait for the ones before it, so per-chunk draws would delay a burst by the largest of them:
    a message written in pieces (gRPC writes headers, data and trailers apart) or a bulk
    transfer would see more than ``latency`` on average, and a bulk transfer less bandwidth.
    """

    type = "latency"
    fields = {"latency": (int, 0), "jitter": (int, 0)}

    def new_state(self, close):
        return {"held_until": -1.0, "jitter_ms": 0.0}

    async def pipe(self, chunk, state):
        if self.jitter and chunk.due > state["held_until"]:
            state["jitter_ms"] = random.uniform(-self.jitter, self.jitter)
        due = chunk.due + (self.latency + state["jitter_ms"]) / 1000
        state["held_until"] = due
        await sleep_until(due)
        yield Chunk(chunk.data, due)


class Bandwidth(Toxic):
    """Caps throughput at ``rate`` KB/s (0: unlimited), releasing data in ≤10 ms slices.

    A virtual clock (when the link is next free) keeps the rate exact over time however coarse
    or late the event loop's timers are: a slice starts when both it is due and the link is free.
    """

    type = "bandwidth"
    fields = {"rate": (int, 0)}

    def new_state(self, close):
        return {"free_at": 0.0}

    async def pipe(self, chunk, state):
        if self.rate <= 0:
            yield chunk
            return
        bytes_per_s = self.rate * 1000
        step = max(1024, bytes_per_s // 100)
        data = chunk.data
        for i in range(0, len(data), step):
            piece = data[i : i + step]
            state["free_at"] = max(state["free_at"], chunk.due) + len(piece) / bytes_per_s
            await sleep_until(state["free_at"])
            yield Chunk(piece, state["free_at"])


class SlowClose(Toxic):
    """Holds the close back ``delay`` ms after the sender finished."""

    type = "slow_close"
    fields = {"delay": (int, 0)}

    async def at_eof(self, state):
        await sleep_until(time.monotonic() + self.delay / 1000)


class Timeout(Toxic):
    """Drops all data; closes the connection after ``timeout`` ms without data (0: never closes).

    Toxiproxy restarts its timer on every chunk it drops, so the close comes ``timeout`` ms after
    the last data (or after the toxic arrived, on a quiet connection).
    """

    type = "timeout"
    fields = {"timeout": (int, 0)}

    def new_state(self, close):
        state = {"close": close, "timer": None}
        self._arm(state)
        return state

    def _arm(self, state):
        if state["timer"]:
            state["timer"].cancel()
        if self.timeout > 0:
            state["timer"] = asyncio.get_running_loop().call_later(self.timeout / 1000, state["close"], False)

    def drop_state(self, state):
        if state["timer"]:
            state["timer"].cancel()

    async def pipe(self, chunk, state):
        self._arm(state)
        return
        yield  # an async generator that yields nothing: the data is dropped


class ResetPeer(Toxic):
    """On the first data, waits ``timeout`` ms and resets the connection (TCP RST, data dropped)."""

    type = "reset_peer"
    fields = {"timeout": (int, 0)}

    async def pipe(self, chunk, state):
        await asyncio.sleep(self.timeout / 1000)
        raise CloseLink(reset=True)
        yield  # pragma: no cover - makes this an async generator


class Slicer(Toxic):
    """Cuts chunks into pieces of ``average_size`` ± ``size_variation`` bytes, ``delay`` µs apart."""

    type = "slicer"
    fields = {"average_size": (int, 0), "size_variation": (int, 0), "delay": (int, 0)}

    def check(self):
        if self.average_size < 1:
            raise ApiError(400, f"slicer needs average_size >= 1 byte, got {self.average_size}")
        if self.size_variation >= self.average_size:
            raise ApiError(
                400,
                f"slicer size_variation ({self.size_variation}) must be less than average_size ({self.average_size})",
            )

    def cuts(self, start: int, end: int) -> list[int]:
        """Offsets splitting [start, end) roughly in halves until pieces are about average_size."""
        if end - start - self.average_size <= self.size_variation:
            return [end]
        mid = start + (end - start) // 2
        if self.size_variation:
            mid += random.randint(-self.size_variation, self.size_variation)
        return self.cuts(start, mid) + self.cuts(mid, end)

    async def pipe(self, chunk, state):
        start = 0
        for end in self.cuts(0, len(chunk.data)):
            yield Chunk(chunk.data[start:end], chunk.due)
            start = end
            if self.delay:
                await asyncio.sleep(self.delay / 1e6)


class LimitData(Toxic):
    """Lets ``bytes`` bytes through this direction, then closes the connection."""

    type = "limit_data"
    fields = {"bytes": (int, 0)}

    def new_state(self, close):
        return {"sent": 0}

    async def pipe(self, chunk, state):
        room = max(0, self.bytes - state["sent"])
        data = chunk.data[:room]
        if data:
            state["sent"] += len(data)
            yield Chunk(data, chunk.due)
        if state["sent"] >= self.bytes:
            raise CloseLink()


class Loss(Toxic):
    """netsim's extension: packet loss as the delay TCP pays to recover it.

    Toxiproxy works on a TCP stream, where a lost packet is never missing, only late: the
    receiver sees nothing until the retransmission arrives. So each ``segment``-byte packet of a
    chunk is lost with ``probability``, and a chunk with a loss is held ``delay`` ms (a tail-loss
    probe or fast retransmit: about 1-2 RTT; Linux's minimum RTO is 200 ms). Later chunks queue
    behind it, as in-order delivery demands. Real Toxiproxy rejects this type; netsim's profiles
    leave it out when they drive one.
    """

    type = "loss"
    fields = {"probability": (float, 0.0), "segment": (int, 1448), "delay": (int, 200)}

    def check(self):
        if not 0.0 <= self.probability <= 1.0:
            raise ApiError(400, f"loss probability must be within [0, 1], got {self.probability}")
        if self.segment < 1:
            raise ApiError(400, f"loss segment must be >= 1 byte, got {self.segment}")

    async def pipe(self, chunk, state):
        packets = math.ceil(len(chunk.data) / self.segment)
        if random.random() < 1.0 - (1.0 - self.probability) ** packets:
            chunk = Chunk(chunk.data, chunk.due + self.delay / 1000)
            await sleep_until(chunk.due)
        yield chunk


TOXICS: dict[str, type[Toxic]] = {
    t.type: t for t in (Latency, Bandwidth, SlowClose, Timeout, ResetPeer, Slicer, LimitData, Loss)
}
EXTENSIONS = {"loss"}


def _number(toxic_type: str, key: str, value: Any, kind: type) -> int | float:
    """A JSON attribute as its Go type would decode it, refusing what Toxiproxy would misuse."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ApiError(400, f"{toxic_type} attribute {key!r} must be a number, got {value!r}")
    if kind is int:
        if value != int(value):
            raise ApiError(400, f"{toxic_type} attribute {key!r} must be a whole number, got {value!r}")
        value = int(value)
    if value < 0:
        raise ApiError(400, f"{toxic_type} attribute {key!r} must not be negative, got {value!r}")
    return value


def make_toxic(body: Any, previous: Toxic | None = None) -> Toxic:
    """Build a toxic from an API request body; with ``previous``, the body updates that toxic."""
    if not isinstance(body, dict):
        raise ApiError(400, f"bad request body: expected a JSON object, got {type(body).__name__}")
    if previous is None:
        toxic_type = body.get("type")
        if toxic_type not in TOXICS:
            raise ApiError(400, f"invalid toxic type: {toxic_type!r} (expected one of {', '.join(sorted(TOXICS))})")
        stream = body.get("stream") or "downstream"
        if stream not in STREAMS:
            raise ApiError(400, f"stream was invalid, can be either upstream or downstream (got {stream!r})")
        name = body.get("name") or f"{toxic_type}_{stream}"
        old_attributes: dict[str, Any] = {}
        toxicity = body.get("toxicity", 1.0)
    else:
        toxic_type, stream, name = previous.type, previous.stream, previous.name
        for key, now in (("type", toxic_type), ("stream", stream), ("name", name)):
            if key in body and body[key] != now:
                raise ApiError(400, f"a toxic's {key} cannot change ({now!r} -> {body[key]!r}); delete and re-add it")
        old_attributes = previous.attributes
        toxicity = body.get("toxicity", previous.toxicity)
    if not isinstance(name, str):
        raise ApiError(400, f"toxic name must be a string, got {name!r}")
    if isinstance(toxicity, bool) or not isinstance(toxicity, int | float) or not 0.0 <= toxicity <= 1.0:
        raise ApiError(400, f"toxicity must be a number within [0, 1], got {toxicity!r}")
    given = body.get("attributes") or {}
    if not isinstance(given, dict):
        raise ApiError(400, f"toxic attributes must be a JSON object, got {given!r}")
    cls = TOXICS[toxic_type]
    unknown = sorted(set(given) - set(cls.fields))
    if unknown:
        names = ", ".join(map(repr, unknown))
        raise ApiError(400, f"{toxic_type} has no attribute {names} (it has {', '.join(cls.fields)})")
    attributes = {}
    for key, (kind, default) in cls.fields.items():
        value = given.get(key, old_attributes.get(key, default))
        attributes[key] = _number(toxic_type, key, value, kind)
    toxic = cls(name, stream, float(toxicity), attributes)
    toxic.check()
    return toxic
