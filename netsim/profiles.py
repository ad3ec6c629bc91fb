"""Named network conditions, applied to a proxy as Toxiproxy toxics in both directions.

Each profile is an added round-trip time (split evenly between the two directions), a jitter
(the round trip varies by up to ± that, uniformly), a bandwidth per direction and a packet loss
rate. On loopback the base link adds nothing measurable, so a profile is the whole link.

Sources:

* ``5g``, ``4g`` — the MoA paper's experimental settings (netem on a base link of ~50 Mbit/s
  and 9 ms ping): 5G adds 10 ± 10 ms at 0.1 % loss on that base link; 4G adds 21 ± 19 ms at
  0.1 % loss and a 20 Mbit/s rate. Their round trips here are base + added: 19 ms and 30 ms.
* ``lte``, ``3g`` — WebPageTest's connectivity profiles (``connectivity.ini``): LTE 12/12 Mbit/s,
  70 ms RTT; 3G 1.6 Mbit/s down, 768 kbit/s up, 300 ms RTT; no loss.
* ``wifi`` — the WiFi preset of Chrome DevTools' network throttling: 30 Mbit/s down, 15 Mbit/s
  up, 2 ms latency.
* ``offline`` — the proxy disabled: live connections are cut, new ones refused.
* ``flaky`` — the ``4g`` link, cut and restored periodically (``period_s`` apart, down for
  ``down_s``); the cutting is done by :class:`netsim.harness.Flapper` or ``splitspec netsim
  apply --profile flaky``, since Toxiproxy itself has no schedule.

Loss is netsim's ``loss`` extension toxic (see :class:`netsim.toxics.Loss`), charged as a
retransmission after a tail-loss probe: 2 RTT (at least 10 ms). A real Toxiproxy has no such
toxic, so against one the profiles drop it and say so.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from netsim.client import ToxiproxyClient
from shared.errors import SplitspecError


@dataclass(frozen=True)
class Profile:
    name: str
    rtt_ms: int = 0  # added round trip, half each way
    jitter_ms: int = 0  # the round trip varies uniformly within ± this
    down_mbps: float = 0.0  # server -> client; 0: unlimited
    up_mbps: float = 0.0  # client -> server; 0: unlimited
    loss: float = 0.0  # probability that a 1448-byte packet is lost, each direction
    offline: bool = False
    flaky: bool = False

    def toxics(self, with_extensions: bool = True) -> list[dict]:
        """The toxic requests (Toxiproxy JSON) that make a proxy behave like this profile."""
        up_rtt, up_jitter = self.rtt_ms // 2, self.jitter_ms // 2
        legs = (
            ("upstream", self.up_mbps, up_rtt, up_jitter),
            ("downstream", self.down_mbps, self.rtt_ms - up_rtt, self.jitter_ms - up_jitter),
        )
        out = []
        for stream, mbps, latency, jitter in legs:
            if latency or jitter:
                out.append(_toxic("latency", stream, latency=latency, jitter=jitter))
            if mbps:
                out.append(_toxic("bandwidth", stream, rate=max(1, round(mbps * 1e6 / 8 / 1000))))
            if self.loss and with_extensions:
                out.append(_toxic("loss", stream, probability=self.loss, delay=max(10, 2 * self.rtt_ms)))
        return out


def _toxic(kind: str, stream: str, **attributes) -> dict:
    return {"name": f"{kind}_{stream}", "type": kind, "stream": stream, "toxicity": 1.0, "attributes": attributes}


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile("none"),
        Profile("5g", rtt_ms=19, jitter_ms=10, down_mbps=50, up_mbps=50, loss=0.001),
        Profile("4g", rtt_ms=30, jitter_ms=19, down_mbps=20, up_mbps=20, loss=0.001),
        Profile("lte", rtt_ms=70, down_mbps=12, up_mbps=12),
        Profile("3g", rtt_ms=300, down_mbps=1.6, up_mbps=0.768),
        Profile("wifi", rtt_ms=2, down_mbps=30, up_mbps=15),
        Profile("offline", offline=True),
        Profile("flaky", rtt_ms=30, jitter_ms=19, down_mbps=20, up_mbps=20, loss=0.001, flaky=True),
    )
}


def get_profile(name: str) -> Profile:
    if name not in PROFILES:
        raise SplitspecError(f"unknown network profile {name!r}; expected one of {', '.join(PROFILES)}")
    return PROFILES[name]


def apply_profile(client: ToxiproxyClient, proxy: str, profile: Profile | str) -> Profile:
    """Replace the proxy's toxics with the profile's; enable it, or disable it for ``offline``."""
    profile = get_profile(profile) if isinstance(profile, str) else profile
    for toxic in client.toxics(proxy):
        client.remove_toxic(proxy, toxic["name"])
    with_extensions = "loss" in client.extensions()
    if profile.loss and not with_extensions:
        message = f"{client.url} has no 'loss' toxic (a real Toxiproxy?): profile {profile.name!r} runs lossless"
        warnings.warn(message, stacklevel=2)
    for toxic in profile.toxics(with_extensions):
        client.request("POST", f"/proxies/{proxy}/toxics", toxic)
    client.update(proxy, enabled=not profile.offline)
    return profile
