"""netsim benchmark: is the proxy out of the way when clean, and does each profile deliver what it says?

1. Overhead: the same loopback traffic direct and through a toxic-free netsim proxy, interleaved
   run by run: bulk throughput (MB/s, 1 MB = 1e6 bytes) and the median added round trip.
2. Profiles: through a proxy with each profile, the median and mean round trip of small pings and
   the goodput of a bulk download and a bulk upload (size / (time - median RTT)), against the
   profile's configured RTT and Mbit/s.

The upstream is a small request server in this process: ``D<n>`` asks for n bytes, ``U<n>``
announces n bytes and gets a one-byte ack, ``P`` is a ping. The proxy runs in its own process.

Run:  .venv/bin/python -m bench.netsim [--profiles 5g,4g,...] [--bulk-mb 128] [--repeats 5]
Writes netsim.json, netsim.md and netsim.png under --out (default bench/results).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import struct
import sys
import threading
import time
from pathlib import Path

from bench.common import machine
from netsim import Netsim, apply_profile, get_profile

REPO = Path(__file__).resolve().parent.parent
PROFILES = ["wifi", "5g", "4g", "lte", "3g"]
HEADER = struct.Struct("!cQ")


def _recv_exactly(s: socket.socket, n: int, chunk: int = 1 << 20) -> None:
    while n:
        got = s.recv_into(memoryview(bytearray(min(n, chunk))))
        if not got:
            raise ConnectionError(f"closed with {n} bytes still expected")
        n -= got


class RequestServer:
    """The upstream: answers pings, sends or swallows bulk data on request."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.zeros = bytes(1 << 20)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            conn, _ = self.sock.accept()
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            try:
                while True:
                    head = bytearray()
                    while len(head) < HEADER.size:
                        piece = conn.recv(HEADER.size - len(head))
                        if not piece:
                            return
                        head += piece
                    op, n = HEADER.unpack(head)
                    if op == b"D":
                        while n:
                            conn.sendall(self.zeros[: min(n, len(self.zeros))])
                            n -= min(n, len(self.zeros))
                    elif op == b"U":
                        _recv_exactly(conn, n)
                        conn.sendall(b"k")
                    else:
                        conn.sendall(b"p")
            except OSError:
                return


def _connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=120)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def pings_ms(s: socket.socket, count: int) -> list[float]:
    out = []
    for _ in range(count):
        start = time.perf_counter()
        s.sendall(HEADER.pack(b"P", 0))
        _recv_exactly(s, 1)
        out.append((time.perf_counter() - start) * 1000)
    return out


def download_s(s: socket.socket, n: int) -> float:
    start = time.perf_counter()
    s.sendall(HEADER.pack(b"D", n))
    _recv_exactly(s, n)
    return time.perf_counter() - start


def upload_s(s: socket.socket, n: int) -> float:
    data = bytes(1 << 20)
    start = time.perf_counter()
    s.sendall(HEADER.pack(b"U", n))
    left = n
    while left:
        s.sendall(data[: min(left, len(data))])
        left -= min(left, len(data))
    _recv_exactly(s, 1)
    return time.perf_counter() - start


def overhead(direct: str, proxied: str, bulk_bytes: int, repeats: int) -> dict:
    """Throughput and round trip, direct vs proxied, alternating so noise hits both alike."""
    runs: dict[str, dict[str, list[float]]] = {k: {"mb_s": [], "rtt_ms": []} for k in ("direct", "proxy")}
    for i in range(repeats):
        for kind, address in (("direct", direct), ("proxy", proxied))[:: 1 if i % 2 == 0 else -1]:
            with _connect(address) as s:
                runs[kind]["rtt_ms"] += pings_ms(s, 200)
                runs[kind]["mb_s"].append(bulk_bytes / download_s(s, bulk_bytes) / 1e6)
    out = {k: {"mb_s": statistics.median(v["mb_s"]), "rtt_ms": statistics.median(v["rtt_ms"])} for k, v in runs.items()}
    out["added_rtt_ms"] = out["proxy"]["rtt_ms"] - out["direct"]["rtt_ms"]
    out["throughput_ratio"] = out["proxy"]["mb_s"] / out["direct"]["mb_s"]
    return out


def profile_run(sim: Netsim, upstream: str, name: str, seconds: float, repeats: int) -> dict:
    profile = get_profile(name)
    proxy = sim.client.create(f"bench-{name}", upstream)
    try:
        apply_profile(sim.client, proxy["name"], profile)
        with _connect(proxy["listen"]) as s:
            rtts = pings_ms(s, 100 if profile.rtt_ms < 100 else 20)
            rtt_s = statistics.median(rtts) / 1000
            down_n = int(profile.down_mbps * 1e6 / 8 * seconds)
            up_n = int(profile.up_mbps * 1e6 / 8 * seconds)
            down = [down_n * 8 / (download_s(s, down_n) - rtt_s) / 1e6 for _ in range(repeats)]
            up = [up_n * 8 / (upload_s(s, up_n) - rtt_s) / 1e6 for _ in range(repeats)]
    finally:
        sim.client.delete(proxy["name"])
    return {
        "profile": name,
        "rtt_ms": profile.rtt_ms,
        "jitter_ms": profile.jitter_ms,
        "loss": profile.loss,
        "measured_rtt_median_ms": statistics.median(rtts),
        "measured_rtt_mean_ms": statistics.mean(rtts),
        "down_mbps": profile.down_mbps,
        "measured_down_mbps": statistics.median(down),
        "up_mbps": profile.up_mbps,
        "measured_up_mbps": statistics.median(up),
    }


def markdown(result: dict) -> str:
    o = result["overhead"]
    lines = [
        "| path | throughput MB/s | median RTT ms |",
        "|---|---:|---:|",
        f"| direct loopback | {o['direct']['mb_s']:.0f} | {o['direct']['rtt_ms']:.3f} |",
        f"| netsim proxy, no toxics | {o['proxy']['mb_s']:.0f} | {o['proxy']['rtt_ms']:.3f} |",
        "",
        f"Proxy overhead: {o['added_rtt_ms']:.3f} ms added per round trip (median), "
        f"{o['throughput_ratio']:.2f}x direct throughput.",
        "",
        "| profile | RTT ms set | RTT ms median / mean | down Mbit/s set / got | up Mbit/s set / got | loss |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for p in result["profiles"]:
        lines.append(
            f"| {p['profile']} | {p['rtt_ms']} ± {p['jitter_ms']} | {p['measured_rtt_median_ms']:.1f} / "
            f"{p['measured_rtt_mean_ms']:.1f} | {p['down_mbps']:g} / {p['measured_down_mbps']:.2f} | "
            f"{p['up_mbps']:g} / {p['measured_up_mbps']:.2f} | {p['loss']:.1%} |"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profiles = result["profiles"]
    names = [p["profile"] for p in profiles]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (set_key, got_key, title) in zip(
        axes,
        [
            ("rtt_ms", "measured_rtt_mean_ms", "round trip (ms)"),
            ("down_mbps", "measured_down_mbps", "download (Mbit/s)"),
            ("up_mbps", "measured_up_mbps", "upload (Mbit/s)"),
        ],
        strict=True,
    ):
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], [p[set_key] for p in profiles], 0.4, label="configured")
        ax.bar([i + 0.2 for i in x], [p[got_key] for p in profiles], 0.4, label="measured")
        ax.set_xticks(list(x), names)
        ax.set_yscale("log")
        ax.set_title(title)
    axes[0].legend()
    fig.suptitle("netsim profiles through the proxy on loopback: configured vs measured")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profiles", default=",".join(PROFILES), help=f"comma list (default {','.join(PROFILES)})")
    p.add_argument("--bulk-mb", type=int, default=128, help="MB per overhead throughput run (default 128)")
    p.add_argument("--repeats", type=int, default=5, help="runs per measurement; medians are reported (default 5)")
    p.add_argument("--seconds", type=float, default=1.0, help="length of each profile bulk transfer (default 1)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = p.parse_args(argv)
    names = [n for n in args.profiles.split(",") if n]
    for n in names:
        get_profile(n)
    upstream = RequestServer()
    with Netsim.start_own() as sim:
        clean = sim.client.create("bench-clean", upstream.address)
        print("overhead: direct vs proxy ...", file=sys.stderr, flush=True)
        result = {
            "overhead": overhead(upstream.address, clean["listen"], args.bulk_mb * 1_000_000, args.repeats),
            "profiles": [],
        }
        for n in names:
            print(f"profile {n} ...", file=sys.stderr, flush=True)
            result["profiles"].append(profile_run(sim, upstream.address, n, args.seconds, args.repeats))
    result["environment"] = machine()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "netsim.json").write_text(json.dumps(result, indent=2) + "\n")
    table = markdown(result)
    header = f"# netsim benchmark\n\n`{result['environment']['command']}` on {result['environment']['cpu']}, "
    header += f"{result['environment']['date']}.\n\n"
    (args.out / "netsim.md").write_text(header + table)
    plot(result, args.out / "netsim.png")
    print(table)
    print(f"wrote {args.out}/netsim.{{json,md,png}}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
