"""Edge device profiles (``netsim.device``): how close a held process comes to its share of one core.

Per profile (phone, laptop, desktop) and mechanism (this kernel's: a cgroup where one is writable; the duty cycle,
forced), a one-thread busy loop is held to the profile's share for ``--seconds``, ``--repeats`` times: the CPU it
got over the wall time, median and range, beside the share.

Run:  .venv/bin/python -m bench.device [--seconds 3] [--repeats 3]
Writes device.json and device.md under --out (default bench/results/device).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from bench.common import finish, machine
from netsim.device import CGROUP, DEVICES, measure

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=3.0, help="each measurement's length (default 3)")
    p.add_argument("--repeats", type=int, default=3, help="measurements per profile and mechanism (default 3)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "device")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as nowhere:  # a root with no cgroups: the duty cycle
        for profile in DEVICES.values():
            for label, root in (("this kernel's", CGROUP), ("duty cycle", Path(nowhere))):
                got = [measure(profile.cpu_share, args.seconds, root=root) for _ in range(args.repeats)]
                shares = [g["achieved"] for g in got]
                row = {"profile": profile.name, "share": profile.cpu_share, "mechanism": label, "how": got[0]["how"]}
                rows.append({**row, "achieved": shares, "median": statistics.median(shares)})
    env = machine()
    lines = ["# Edge device profiles: a busy loop held to a share of one core\n",
             f"`{env['command']}`\n", f"{env['date']}, {env['cpu']}, load {env['load_avg_1m']:.2f} at the start.\n",
             "| profile | share | mechanism | got (median) | range | median ÷ share | how |",
             "|---|---:|---|---:|---|---:|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['profile']} | {r['share']:g} | {r['mechanism']} | {r['median']:.3f} | "
                     f"{min(r['achieved']):.3f}–{max(r['achieved']):.3f} | {r['median'] / r['share']:.3f} | "
                     f"{r['how']} |")  # fmt: skip
    return finish(args.out, "device", {"environment": env, "rows": rows}, "\n".join(lines), png=False)


if __name__ == "__main__":
    raise SystemExit(main())
