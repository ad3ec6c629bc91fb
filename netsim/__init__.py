"""netsim: a Toxiproxy-compatible network simulator for loopback experiments.

``api`` serves Toxiproxy 2.x's HTTP API, ``proxy`` is the asyncio data plane, ``toxics`` the
stages of its pipes, ``profiles`` the named 5G/4G/LTE/3G/WiFi/offline/flaky links, ``harness``
the Python API for tests and benchmarks, ``client`` a small API client that also drives a real
``toxiproxy-server``.
"""

from netsim.harness import Netsim, SimulatedLink, simulated_link
from netsim.profiles import PROFILES, Profile, apply_profile, get_profile

__all__ = ["PROFILES", "Netsim", "Profile", "SimulatedLink", "apply_profile", "get_profile", "simulated_link"]
