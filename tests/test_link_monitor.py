"""The link monitor: RTT and bandwidth from RPC timings, the active probe, and the Probe RPC on loopback.

Synthetic links follow the monitor's own model, ``net = rtt + bytes_up / up + bytes_down / down``,
with jitter on the RTT; the fake probe link advances a fake clock, so nothing here sleeps.
"""

from __future__ import annotations

import json
import random

import grpc
import pytest

from client.drafters import make_drafter
from client.loop.decode import generate
from client.net.link import LinkMonitor
from client.net.remote import RemoteVerifier
from client.verifiers import LocalVerifier
from server.limits import ServerLimits
from shared.wire import splitspec_pb2 as pb
from shared.wire import splitspec_pb2_grpc as pb_grpc

MBIT = 1e6 / 8  # bytes per second in one Mbit/s
TIMEOUT = 30.0


class FakeLink:
    """A link with a known RTT and rates (bytes/s), jitter on the RTT, and a clock that calls advance."""

    def __init__(self, rtt_s: float, down: float, up: float, jitter: float = 0.03, seed: int = 0):
        self.rtt_s, self.down, self.up, self.jitter = rtt_s, down, up, jitter
        self.rng = random.Random(seed)
        self.now = 0.0
        self.sizes: list[tuple[int, int]] = []

    def net_s(self, bytes_up: int, bytes_down: int) -> float:
        rtt = self.rtt_s * (1 + self.rng.uniform(-self.jitter, self.jitter))
        return rtt + bytes_up / self.up + bytes_down / self.down

    def call(self, payload_bytes: int, reply_bytes: int, timeout_s: float) -> tuple[float, float]:
        """A Probe round trip: the server computes a little, the clock moves; past the timeout it gives up."""
        self.sizes.append((payload_bytes, reply_bytes))
        compute = 0.0005
        wall = self.net_s(payload_bytes, reply_bytes) + compute
        if wall > timeout_s:
            self.now += timeout_s
            raise TimeoutError
        self.now += wall
        return wall, compute

    def clock(self) -> float:
        return self.now


def feed_traffic(monitor: LinkMonitor, link: FakeLink, calls: int = 300) -> None:
    """Decode-like traffic: small Verify rounds with server compute, now and then a large download or upload."""
    for i in range(calls):
        up, down = 600, 60
        if i % 5 == 4:
            down = 256 * 1024
        elif i % 7 == 6:
            up = 128 * 1024
        compute = link.rng.uniform(0.005, 0.02)
        assert monitor.observe(link.net_s(up, down) + compute, compute, up, down)


# --- passive estimates ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rtt_s, down_mbps, up_mbps", [(0.04, 20.0, 5.0), (0.015, 100.0, 20.0), (0.2, 2.0, 0.5)], ids=["4g", "5g", "3g"]
)
def test_observe_recovers_rtt_and_bandwidth(rtt_s: float, down_mbps: float, up_mbps: float):
    link = FakeLink(rtt_s, down_mbps * MBIT, up_mbps * MBIT)
    monitor = LinkMonitor()
    feed_traffic(monitor, link)
    assert monitor.rtt_ms == pytest.approx(rtt_s * 1e3, rel=0.03)
    assert monitor.bandwidth_mbps == pytest.approx(down_mbps, rel=0.05)
    assert monitor.uplink_mbps == pytest.approx(up_mbps, rel=0.05)
    assert 0 < monitor.rttvar_s < 0.05 * rtt_s  # jitter of +-3 %
    assert monitor.timeout_s() == pytest.approx(monitor.srtt_s + 4 * monitor.rttvar_s)
    assert monitor.as_stats() == {
        "rtt_ms": monitor.rtt_ms,
        "bandwidth_mbps": monitor.bandwidth_mbps,
        "uplink_mbps": monitor.uplink_mbps,
    }


def test_small_calls_give_rtt_but_no_bandwidth():
    link = FakeLink(0.03, 10 * MBIT, 10 * MBIT)
    monitor = LinkMonitor()
    assert monitor.as_stats() == {"rtt_ms": None, "bandwidth_mbps": None, "uplink_mbps": None}
    assert monitor.timeout_s() is None
    for _ in range(50):
        monitor.observe(link.net_s(500, 50), 0.0, 500, 50)
    assert monitor.rtt_ms == pytest.approx(30, rel=0.05)
    assert monitor.bandwidth_mbps is None and monitor.uplink_mbps is None


def test_a_streamed_payloads_arrival_gap_measures_the_downlink():
    """A stream's prompt payload arrives after a small chunk: its gap, less the server's step, is its transfer."""
    monitor = LinkMonitor()
    monitor.observe_gap(0.01 + 64 * 1024 / 2e5, 0.01, 64 * 1024)  # 3G: 200 KB/s
    assert monitor.down_rate == pytest.approx(2e5)
    monitor.observe_gap(0.5, 0.01, 8 * 1024)  # too small to time: ignored
    assert monitor.down_rate == pytest.approx(2e5)
    fast = LinkMonitor()
    fast.observe_gap(0.0101, 0.01, 64 * 1024)  # loopback: no time to speak of, but the rate is at least 6.5 MB/s
    assert fast.down_rate == pytest.approx(64 * 1024 / 0.01)


def test_rtt_follows_a_step_within_a_few_samples():
    monitor = LinkMonitor()
    for _ in range(30):
        monitor.observe(0.020, 0.0, 100, 100)
    assert monitor.srtt_s == pytest.approx(0.020)
    for n in range(1, 21):
        monitor.observe(0.080, 0.0, 100, 100)
        if n == 5:  # gain 1/8: 1 - (7/8)^5 = 49 % of the way
            assert monitor.srtt_s > 0.020 + 0.4 * 0.060
            assert monitor.timeout_s() > 0.080  # RTTVAR opened up at once: a step is not a disconnect
    assert monitor.srtt_s == pytest.approx(0.080, rel=0.1)


@pytest.mark.parametrize(
    "wall_s, compute_s, up, down",
    [(0.010, 0.020, 100, 100), (0.010, 0.010, 100, 100), (float("nan"), 0.0, 1, 1), (0.01, -0.001, 1, 1),
     (float("inf"), 0.0, 1, 1), (0.01, 0.0, -5, 1)],
    ids=["negative-net", "zero-net", "nan", "negative-compute", "inf", "negative-bytes"],
)  # fmt: skip
def test_absurd_samples_are_ignored(wall_s: float, compute_s: float, up: int, down: int):
    monitor = LinkMonitor()
    feed_traffic(monitor, FakeLink(0.04, 20 * MBIT, 5 * MBIT))
    before = monitor.as_stats(), monitor.rttvar_s, monitor.samples
    assert not monitor.observe(wall_s, compute_s, up, down)
    assert (monitor.as_stats(), monitor.rttvar_s, monitor.samples) == before


# --- the active probe -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rtt_s, down_mbps, up_mbps", [(0.04, 20.0, 5.0), (0.015, 100.0, 20.0), (0.001, 800.0, 800.0)],
    ids=["4g", "5g", "lan"],
)  # fmt: skip
def test_probe_recovers_the_link(rtt_s: float, down_mbps: float, up_mbps: float):
    link = FakeLink(rtt_s, down_mbps * MBIT, up_mbps * MBIT)
    monitor = LinkMonitor()
    result = monitor.probe(link.call, budget_s=1.5, clock=link.clock)
    assert result["rtt_ms"] == pytest.approx(rtt_s * 1e3, rel=0.05)
    assert result["bandwidth_mbps"] == pytest.approx(down_mbps, rel=0.05)
    assert result["uplink_mbps"] == pytest.approx(up_mbps, rel=0.05)
    assert {k: result[k] for k in monitor.as_stats()} == monitor.as_stats()  # medians replace the estimates
    assert result["elapsed_s"] == pytest.approx(link.now) and link.now <= 1.5
    assert result["calls"] == len(link.sizes)
    assert max(max(s) for s in link.sizes) <= 4 * 1024 * 1024


def test_probe_respects_its_budget_on_a_slow_link():
    link = FakeLink(0.3, 1 * MBIT, 0.25 * MBIT)  # a 32 KB upload alone takes 1 s
    monitor = LinkMonitor()
    result = monitor.probe(link.call, budget_s=1.5, clock=link.clock)
    assert link.now <= 1.5 and result["elapsed_s"] <= 1.5
    assert result["rtt_ms"] == pytest.approx(300, rel=0.05)
    assert result["uplink_mbps"] is None and monitor.uplink_mbps is None  # no time for it: unknown, not guessed


def test_probe_respects_max_bytes():
    link = FakeLink(0.001, 800 * MBIT, 800 * MBIT)
    LinkMonitor().probe(link.call, budget_s=1.5, max_bytes=100_000, clock=link.clock)
    assert max(max(s) for s in link.sizes) == 100_000


# --- on loopback, against the tiny server -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stub(tiny_server):
    address, _ = tiny_server
    with grpc.insecure_channel(address) as channel:
        yield pb_grpc.SplitSpecStub(channel)


def test_probe_rpc_replies_with_the_bytes_asked_for(stub):
    reply = stub.Probe(pb.ProbeRequest(payload=bytes(50_000), reply_bytes=123_457), timeout=TIMEOUT)
    assert len(reply.payload) == 123_457 and reply.compute_s >= 0
    assert len(stub.Probe(pb.ProbeRequest(), timeout=TIMEOUT).payload) == 0
    limits = stub.Handshake(pb.HandshakeRequest(), timeout=TIMEOUT).limits
    assert limits.max_probe_bytes == ServerLimits().max_probe_bytes


def test_probe_rpc_refuses_more_than_the_limit(stub):
    limit = ServerLimits().max_probe_bytes
    with pytest.raises(grpc.RpcError) as info:
        stub.Probe(pb.ProbeRequest(reply_bytes=limit + 1), timeout=TIMEOUT)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert str(limit + 1) in info.value.details() and str(limit) in info.value.details()


def test_remote_generation_reports_the_link(tiny_server):
    address, _ = tiny_server
    remote = RemoteVerifier(address)
    try:
        gen = generate(remote, make_drafter("prompt-lookup"), [5, 6, 7, 5, 6], 8)
        assert 0 < gen.stats.rtt_ms < 50  # loopback
        stats = json.loads(json.dumps(gen.stats.as_dict()))  # what `generate --json` prints
        assert stats["rtt_ms"] == pytest.approx(gen.stats.rtt_ms, abs=1e-5)
        assert "bandwidth_mbps" in stats and "uplink_mbps" in stats

        calls, sent = remote.counters.server_calls, remote.counters.bytes_sent
        result = remote.connection.probe_link(budget_s=1.0)
        assert 0 < result["rtt_ms"] < 50 and result["bandwidth_mbps"] and result["uplink_mbps"]
        assert result["elapsed_s"] <= 1.2
        assert (remote.counters.server_calls, remote.counters.bytes_sent) == (calls, sent)  # counted apart
        assert remote.counters.probe_calls == result["calls"] and remote.counters.probe_bytes > 64 * 1024

        gen = generate(remote, make_drafter("none"), [5, 6, 7], 4)
        assert gen.stats.bandwidth_mbps is not None and gen.stats.uplink_mbps is not None  # the probe's, kept
    finally:
        remote.shutdown()


def test_local_generation_has_no_link(tiny_target):
    gen = generate(LocalVerifier(tiny_target), make_drafter("none"), [5, 6, 7], 3)
    stats = gen.stats.as_dict()
    assert stats["rtt_ms"] is None and stats["bandwidth_mbps"] is None and stats["uplink_mbps"] is None
    json.dumps(stats)
