"""Self-distilled data against ShareGPT's answers, at an equal training budget.

The same drafters (default ``medusa,eagle``, trained together: one teacher forward per batch) are trained
twice from scratch with the same budget of ``--tokens`` target tokens, seed, schedule and draft vocabulary:
once on ShareGPT conversations as written (``splitspec train --shards``), once on the target's own greedy
answers to the same conversations' opening user turns (``splitspec train --self-distill``, ``--distill-tokens``
of generated data, cycled). Then ``bench.single`` measures each bundle's acceptance length τ on MT-Bench and
HumanEval prompts (greedy, target in-process; τ does not depend on the machine's load, so this may run beside
other work — its tok/s columns may not). Training resumes where a previous run of this script stopped
(``--work`` keeps the data, checkpoints and bundles), so a long comparison can span sittings.

Run:  .venv/bin/python -m bench.self_distill [--tokens 100000] [--distill-tokens 300000] [--drafters medusa,eagle]
      [--limit 3] [--max-new-tokens 64] [--work DIR]
Writes self_distill.json and self_distill.md under --out (default bench/results/self-distill).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from bench.common import environment, save_results

REPO = Path(__file__).resolve().parent.parent
DATA = {"sharegpt": [], "self-distilled": ["--self-distill"]}
DATASETS = ("mt-bench", "humaneval")


def train(args: argparse.Namespace, data: str) -> Path:
    """Train (or finish training) the drafters on one kind of data; the folder holding their bundles."""
    out = args.work / data
    command = [sys.executable, "-m", "shared.cli", "train", "--drafter", args.drafters, "--tokens", str(args.tokens),
               "--warmup-tokens", str(args.warmup_tokens), "--shards", str(args.work / f"{data}-data"), "--out",
               str(out), "--checkpoint-every", "300", "--resume", *DATA[data]]  # fmt: skip
    if data == "self-distilled":
        command += ["--distill-tokens", str(args.distill_tokens)]
    print("$", " ".join(command[2:]), flush=True)
    subprocess.run(command, cwd=REPO, check=True)
    return out


def measure(args: argparse.Namespace, bundles: Path) -> dict:
    """bench.single's summary for the drafters in ``bundles`` (plain decoding beside them)."""
    out = bundles / "single"
    command = [sys.executable, "-m", "bench.single", "--drafters", f"none,{args.drafters}", "--bundle-dir",
               str(bundles), "--limit", str(args.limit), "--max-new-tokens", str(args.max_new_tokens), "--out",
               str(out)]  # fmt: skip
    print("$", " ".join(command[2:]), flush=True)
    subprocess.run(command, cwd=REPO, check=True)
    return json.loads((out / "single.json").read_text())["summary"]


def table(rows: list[dict]) -> str:
    lines = ["| drafter | data | τ MT-Bench | τ HumanEval | τ mean | vs ShareGPT | ≠ plain |",
             "|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        ratio = f"{r['ratio']:.2f}×" if r["ratio"] is not None else "–"
        lines.append(f"| {r['drafter']} | {r['data']} | {r['tau']['mt-bench']:.2f} | {r['tau']['humaneval']:.2f} | "
                     f"{r['tau_mean']:.2f} | {ratio} | {r['mismatches']} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafters", default="medusa,eagle", help="drafter kinds trained together (default medusa,eagle)")
    p.add_argument("--tokens", type=int, default=100_000, help="training budget, target tokens (default 100000)")
    p.add_argument("--warmup-tokens", type=int, default=10_000, help="learning-rate warm-up (default 10000)")
    p.add_argument("--distill-tokens", type=int, default=300_000, help="self-distilled data to generate (default "
                   "300000; training cycles over it)")
    p.add_argument("--limit", type=int, default=3, help="first K prompts of each dataset (default 3)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per answer (default 64)")
    p.add_argument("--work", type=Path, default=Path.home() / ".cache" / "splitspec" / "self-distill",
                   help="data, checkpoints and bundles (default ~/.cache/splitspec/self-distill)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "self-distill", help="output folder")
    args = p.parse_args(argv)
    summaries = {data: measure(args, train(args, data)) for data in DATA}
    rows = []
    for kind in args.drafters.split(","):
        base = None
        for data, summary in summaries.items():
            per = summary[kind]
            tau = {d: per[d]["mean_acceptance_length"] for d in DATASETS}
            mean = sum(tau.values()) / len(tau)
            base = mean if base is None else base
            rows.append({"drafter": kind, "data": data, "tau": tau, "tau_mean": round(mean, 3),
                         "ratio": None if data == "sharegpt" else round(mean / base, 3),
                         "mismatches": sum(per[d]["mismatches"] for d in DATASETS)})  # fmt: skip
    md = table(rows)
    print(md)
    header = (f"Equal budget: {args.tokens} target tokens per run, drafters {args.drafters} trained together, "
              f"{args.limit} MT-Bench + {args.limit} HumanEval prompts, {args.max_new_tokens} new tokens, greedy.\n\n")
    save_results(args.out, "self_distill", {"environment": environment(2), "args": {k: str(v) for k, v in
                 vars(args).items()}, "rows": rows}, header + md)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
