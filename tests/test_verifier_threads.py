"""The client's other threads racing its end: a reconnection poll (``client.loop.offline``'s thread, through
``RemoteVerifier.reachable``) and the heartbeat reconnecting, each while the client shuts down.

Before: a poll that failed because shutdown closed the channel swapped in a new one that nobody closed, and a
call after shutdown raised gRPC's ValueError; the heartbeat's close waited 1 s for a thread that went on waiting
up to 4 s for its new connection, and left it running.

No wall-clock bound: the poll and the wait for a connection are given ``LONG_S``, far longer than the test, and the
shutdowns are given ``JOIN_S`` to end their threads; a thread still alive after that was not cancelled, whatever
the machine's load.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest

from client.loop.offline import Backoff, Reconnector
from client.net import heartbeat as heartbeat_module
from client.net.endpoint import Endpoint
from client.net.heartbeat import Heartbeat
from client.net.link import LinkMonitor
from client.net.remote import RemoteVerifier
from shared.errors import SplitspecError
from shared.tree import DraftTree
from shared.wire import splitspec_pb2 as pb
from shared.wire import splitspec_pb2_grpc as pb_grpc

LONG_S = 600.0  # a poll's time, a stalled server's hold, a wait for a connection: never run out within a test
JOIN_S = 30.0  # what a shutdown is given to end its thread (a cancelled one ends at once)


class Stalling(pb_grpc.SplitSpecServicer):
    """Answers Handshake at once until ``stall`` is set, then holds each one until ``release`` (a server that went
    silent with the connection open)."""

    def __init__(self):
        self.stall, self.stalled, self.release = threading.Event(), threading.Event(), threading.Event()

    def Handshake(self, request, context):
        if self.stall.is_set():
            self.stalled.set()
            self.release.wait(LONG_S)
        return pb.HandshakeReply(protocol_version=1, limits=pb.Limits(max_tree_nodes=16, max_context=128))


def serve(servicer=None) -> tuple[grpc.Server, str]:
    """A gRPC server on a free loopback port (no services at all without ``servicer``: connections still open)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    if servicer is not None:
        pb_grpc.add_SplitSpecServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
def opened(monkeypatch) -> list[grpc.Channel]:
    """Every channel an Endpoint opens during the test."""
    channels = []
    original = Endpoint.channel

    def channel(self, options=None):
        channels.append(original(self, options))
        return channels[-1]

    monkeypatch.setattr(Endpoint, "channel", channel)
    return channels


def is_closed(channel: grpc.Channel) -> bool:
    try:
        call = pb_grpc.SplitSpecStub(channel).Probe.future(pb.ProbeRequest(), timeout=0.01)
    except ValueError:  # "Cannot invoke RPC: Channel closed!"
        return True
    call.cancel()
    return False


def all_closed(channels: list[grpc.Channel]) -> bool:
    """Whether every channel is closed within ``JOIN_S``: a shutdown closes its channel off its own thread
    (``close_soon``, as a close can block), so the close lands a moment after the shutdown returns — on a loaded
    machine (AMD Zen 3, the suite on two workers), after the next line had looked."""
    deadline = time.monotonic() + JOIN_S
    while not all(is_closed(c) for c in channels):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_reconnection_poll_racing_shutdown_leaves_no_channel_and_no_thread(opened):
    stalling = Stalling()
    server, address = serve(stalling)
    try:
        verifier = RemoteVerifier(address, connect_timeout_s=5)
        stalling.stall.set()  # the server goes silent: the next Handshake poll hangs
        reconnector = Reconnector(lambda: verifier.reachable(timeout_s=LONG_S), Backoff(seed=0))
        reconnector.start()
        assert stalling.stalled.wait(30), "the poll never reached the server"
        reconnector.stop.set()  # as client.loop.offline.bridge does when it gives up
        verifier.shutdown(timeout_s=JOIN_S)  # the server holds the poll and its time is LONG_S: only a cancel ends it
        assert not stalling.release.is_set() and not reconnector.is_alive(), "shutdown did not cancel the poll"
        assert len(opened) >= 1 and all_closed(opened), [is_closed(c) for c in opened]
        assert verifier.reachable(timeout_s=0.1) is False  # after shutdown: no poll, no new channel
        with pytest.raises(SplitspecError, match="shut down"):  # not gRPC's ValueError
            verifier.verify(DraftTree())
        assert all_closed(opened)
    finally:
        stalling.release.set()
        server.stop(grace=None)


def test_closing_the_heartbeat_while_it_reconnects_ends_its_thread_and_closes_its_channels(opened, monkeypatch):
    monkeypatch.setattr(heartbeat_module, "READY_WAIT_S", LONG_S)  # its wait for a new connection never runs out
    server, address = serve()
    try:
        heartbeat = Heartbeat(Endpoint(address), LinkMonitor(), busy=lambda: False).start()
        grpc.channel_ready_future(heartbeat.channel).result(timeout=5)
    finally:
        server.stop(grace=None)  # the link goes: a new connection cannot come up
    heartbeat.revive()  # the thread reconnects: a new channel, then it waits for it to come up
    deadline = time.monotonic() + JOIN_S
    while len(opened) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(opened) == 2, "the heartbeat never reconnected"
    time.sleep(0.1)  # (it waits for the new connection now, for LONG_S unless cancelled)
    heartbeat.close(timeout_s=JOIN_S)
    assert not heartbeat._thread.is_alive(), "close did not cancel the wait for the new connection"
    assert all_closed(opened), [is_closed(c) for c in opened]
    assert not heartbeat.dead.is_set()  # closing is not the link failing
