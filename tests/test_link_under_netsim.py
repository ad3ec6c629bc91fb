"""The client's link monitor through netsim profiles: it must see the link the profile sets up.

The tiny server runs in this process, netsim in its own; the client probes the link, then
generates, and its smoothed estimates are compared with the profile's configured RTT and rates.
"""

from __future__ import annotations

import json

import pytest

from client.drafters import make_drafter
from client.loop.decode import generate
from client.net.remote import RemoteVerifier
from netsim import get_profile, simulated_link
from shared.cli import main as splitspec


@pytest.mark.parametrize("profile", ["4g", "lte"])
def test_link_monitor_sees_the_profile(tiny_server, netsim_server, profile):
    """The estimates match the profile. They are timings on a shared 2-core machine: a stall during a transfer
    reads as a slower link (once seen in a full suite run: 13 Mbit/s on a 20 Mbit/s link), so a measurement
    that misses is taken again, on a fresh link, up to three times in all, before the test fails (two stalled
    measurements in a row were seen once too: 12.8 Mbit/s on the same link, in a clean-clone run)."""
    address, _ = tiny_server
    configured = get_profile(profile)
    for attempt in range(3):
        with simulated_link(address, profile, netsim=netsim_server) as link:
            remote = RemoteVerifier(link.address)
            try:
                probe = remote.connection.probe_link(budget_s=4.0)
                gen = generate(remote, make_drafter("prompt-lookup"), [5, 6, 7, 5, 6, 7, 5], 24)
            finally:
                remote.shutdown()
        assert probe["bandwidth_mbps"] and probe["uplink_mbps"], probe
        stats = gen.stats
        assert stats.server_calls >= 3  # the estimates went on through the generation's own calls
        measured = (stats.rtt_ms, stats.bandwidth_mbps, stats.uplink_mbps)
        expected = (configured.rtt_ms, configured.down_mbps, configured.up_mbps)
        if measured == pytest.approx(expected, rel=0.25) or attempt == 2:
            break
    assert stats.rtt_ms == pytest.approx(configured.rtt_ms, rel=0.25)
    assert stats.bandwidth_mbps == pytest.approx(configured.down_mbps, rel=0.25)
    assert stats.uplink_mbps == pytest.approx(configured.up_mbps, rel=0.25)


def test_generate_via_netsim_reports_the_link(tiny_server, tiny_model_dir, netsim_server, monkeypatch, capsys):
    address, _ = tiny_server
    monkeypatch.setenv("TOXIPROXY_URL", netsim_server.client.url)
    argv = ["generate", "--server", address, "--model", str(tiny_model_dir), "--prompt", "w1 w2 w3 w1 w2"]
    assert splitspec([*argv, "--via-netsim", "lte", "--max-new-tokens", "6", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["network"] == "lte" and out["stats"]["new_tokens"] == 6
    assert out["stats"]["rtt_ms"] == pytest.approx(70, rel=0.25)
    assert out["stats"]["bandwidth_mbps"] == pytest.approx(12, rel=0.25)
    assert netsim_server.client.proxies() == {}  # the proxy went away with the generation
