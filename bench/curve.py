"""Learning curve: τ on held-out prompts for every checkpoint a training run kept (`splitspec train --history`).

Each snapshot in ``--history`` (``<tokens>/<drafter>``, written at every checkpoint) drafts the same held-out
prompts (MT-Bench first turns, HumanEval: never trained on) against the target; τ, the tokens a verification round
yields, says whether more training tokens would pay. Every generation is checked against plain decoding's ids.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from bench.common import environment, finish, first_difference, save_figure, start
from bench.single import DATASETS, REFERENCE, Method, load_prompts, run_method
from client.drafters import NoDrafter, make_drafter
from shared.engine.models import DEFAULT_MODEL, load_target

REPO = Path(__file__).resolve().parent.parent


def snapshots(history: Path, names: list[str] | None) -> list[tuple[int, str, Path]]:
    """(tokens trained, drafter name, bundle folder) for each kept checkpoint, fewest tokens first."""
    found = []
    for folder in sorted(p for p in history.iterdir() if p.is_dir() and p.name.isdigit()):
        for bundle in sorted(p for p in folder.iterdir() if (p / "config.json").is_file()):
            if names is None or bundle.name in names:
                found.append((int(folder.name), bundle.name, bundle))
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--history", type=Path, required=True, help="a training run's history folder (--out/history)")
    p.add_argument("--drafters", help="comma list of drafter names to measure (default: every one kept)")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"the target (default {DEFAULT_MODEL})")
    p.add_argument("--limit", type=int, default=2, help="first K prompts of each dataset (default 2)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="token budget per generation (default 64)")
    p.add_argument("--tree-width", type=int, default=4, help="EAGLE-2 tree width B (default 4)")
    p.add_argument("--tree-depth", type=int, default=5, help="EAGLE-2 tree depth D (default 5)")
    p.add_argument("--max-tree-nodes", type=int, default=16, help="tree nodes per round (default 16)")
    p.add_argument("--every", type=int, default=1, help="measure every N-th snapshot (the last always; default 1)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "curve")
    args = p.parse_args(argv)
    if not args.history.is_dir():
        p.error(f"--history {args.history} is not a folder (train with --history to keep one)")
    for name in ("limit", "max_new_tokens", "every", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    names = [n.strip() for n in args.drafters.split(",")] if args.drafters else None
    found = snapshots(args.history, names)
    if not found:
        p.error(f"no bundles under {args.history}/<tokens>/" + (f" named {names}" if names else ""))
    steps = sorted({t for t, _, _ in found})
    keep = set(steps[:: args.every]) | {steps[-1]}
    found = [f for f in found if f[0] in keep]

    start(args.threads)
    target = load_target(args.model, device=args.device, dtype="auto")
    prompts = load_prompts(target.tokenizer, args.limit)
    plain = Method(REFERENCE, NoDrafter(), 1)
    reference = {(q.dataset, q.index): run_method(target, plain, q.ids, args.max_new_tokens).token_ids
                 for q in tqdm(prompts, desc="plain", file=sys.stderr)}  # fmt: skip
    rows, mismatches = [], 0
    for tokens, name, path in tqdm(found, desc="snapshots", unit="bundle", file=sys.stderr):
        drafter = make_drafter(str(path), target=target, width=args.tree_width, depth=args.tree_depth)
        method = Method(name, drafter, args.max_tree_nodes)
        per = {d: [] for d in DATASETS}
        for k, q in enumerate(prompts):
            gen = run_method(target, replace(method), q.ids, args.max_new_tokens, seed=k)
            differs = first_difference(gen.token_ids, reference[(q.dataset, q.index)])
            if differs is not None:
                mismatches += 1
                print(f"MISMATCH: {name} at {tokens} tokens, {q.dataset} {q.index}: token {differs}", file=sys.stderr)
            per[q.dataset].append(gen.stats.acceptance_length)
        rows.append({"tokens": tokens, "drafter": name,
                     **{f"tau_{d}": round(statistics.fmean(v), 3) for d, v in per.items() if v}})  # fmt: skip

    env = {**environment(args.threads, args.device), "served": target.describe()}
    lines = [f"# Learning curve\n\n`{env['command']}`\n\n{env['date']}, {args.model} ({target.describe()}), "
             f"{env['threads']} threads of {env['cpu_count']} CPUs ({env['cpu']}); {args.limit} MT-Bench first turns "
             f"+ {args.limit} HumanEval problems (held out of training), greedy, ≤{args.max_new_tokens} new tokens, "
             f"static EAGLE-2 trees B={args.tree_width}, D={args.tree_depth}, ≤{args.max_tree_nodes} nodes. "
             f"τ = tokens per verification round, mean over prompts. {mismatches} generations differ from plain "
             f"decoding.", "", "| tokens trained | drafter | " + " | ".join(f"τ {d}" for d in DATASETS) + " |",
             "|---:|---|" + "---:|" * len(DATASETS)]  # fmt: skip
    lines += [f"| {r['tokens']:,} | {r['drafter']} | " + " | ".join(f"{r.get(f'tau_{d}', float('nan')):.2f}"
                                                                  for d in DATASETS) + " |" for r in rows]  # fmt: skip
    result = {"environment": env, "args": {**vars(args), "history": str(args.history), "out": str(args.out)},
              "rows": rows, "mismatches": mismatches}  # fmt: skip
    md = "\n".join(lines)
    finish(args.out, "curve", result, md)
    plot(rows, args.out / "curve.png", f"{args.model}: τ vs training tokens")
    return 1 if mismatches else 0


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in dict.fromkeys(r["drafter"] for r in rows):
        for d, style in zip(DATASETS, ("--", "-"), strict=True):
            mine = [r for r in rows if r["drafter"] == name and f"tau_{d}" in r]
            ax.plot([r["tokens"] for r in mine], [r[f"tau_{d}"] for r in mine], style, marker="o",
                    label=f"{name} {d}")  # fmt: skip
    ax.set_xlabel("target tokens trained")
    ax.set_ylabel("τ (tokens per round)")
    ax.legend(fontsize=8)
    save_figure(fig, path, title)


if __name__ == "__main__":
    raise SystemExit(main())
