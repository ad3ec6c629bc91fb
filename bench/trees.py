"""Tree-shape sweep: one trained drafter under several EAGLE-2 tree shapes (width B, depth D, node budget m).

The right tree depends on the machine: a bigger tree raises τ but each verification of it costs more target
time, and on a CPU that cost grows with every node (DESIGN §4: 1 token 58 ms, 16 tokens 99 ms). This runs
plain decoding plus the drafter under each shape on the same prompts, interleaved as ``bench.single`` does,
and reports τ, tok/s and speedup per shape: the defaults of ``splitspec generate`` come from it.

Run:  .venv/bin/python -m bench.trees [--drafter moa-tli3] [--shapes 4x5x16,8x6x62] [--limit K]
Writes trees.json, trees.md and trees.png under --out (default bench/results).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from bench import single
from bench.common import bundle_problem, environment, finish, served_target, start
from client.drafters import make_drafter
from shared.engine.models import DEFAULT_MODEL, encode_prompt

REPO = Path(__file__).resolve().parent.parent
DEFAULT_SHAPES = "2x3x6,3x4x10,4x5x16,4x6x24,8x6x32,8x6x62"  # the last is the MoA paper's B=8, D=6, m=62


def parse_shape(text: str) -> tuple[int, int, int]:
    try:
        width, depth, nodes = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a tree shape is WIDTHxDEPTHxNODES like 4x5x16, got {text!r}") from None
    if min(width, depth, nodes) < 1:
        raise argparse.ArgumentTypeError(f"tree shape {text!r}: width, depth and nodes must be >= 1")
    return width, depth, nodes


def shape_name(drafter: str, shape: tuple[int, int, int]) -> str:
    return f"{drafter} B{shape[0]} D{shape[1]} m{shape[2]}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", default="moa-tli3", help="a trained drafter's name or bundle path (default moa-tli3)")
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"comma list of BxDxM (default {DEFAULT_SHAPES})")
    p.add_argument("--limit", type=int, default=6, help="first K prompts of each dataset (default 6)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="token budget per generation (default 128)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"the target (default {DEFAULT_MODEL})")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results", help="output folder")
    args = p.parse_args(argv)
    try:
        args.shapes = [parse_shape(s) for s in args.shapes.split(",") if s.strip()]
    except argparse.ArgumentTypeError as exc:
        p.error(str(exc))
    if not args.shapes or args.limit < 1 or args.max_new_tokens < 1:
        p.error("need at least one shape, --limit >= 1 and --max-new-tokens >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start(args.threads)
    target, dtype = served_target(args.model)
    path = single.bundle_path(args.drafter, None, target) if not Path(args.drafter).is_dir() else Path(args.drafter)
    if path is None:
        print(f"error: no bundle for {args.drafter!r}; train one or pass a bundle folder", file=sys.stderr)
        return 2
    if (why := bundle_problem(str(path), target)) is not None:  # one made for another target
        print(f"error: {why}", file=sys.stderr)
        return 2
    methods = [single.Method(single.REFERENCE, make_drafter(single.REFERENCE), single.UNTRAINED_MAX_TREE_NODES)]
    for shape in args.shapes:
        drafter = make_drafter(str(path), target=target, width=shape[0], depth=shape[1])
        methods.append(single.Method(shape_name(args.drafter, shape), drafter, shape[2]))
    prompts = single.load_prompts(target.tokenizer, args.limit)
    warm_ids = encode_prompt(target.tokenizer, single.WARMUP_PROMPT, chat=True)
    for method in tqdm(methods, desc="warm-up", unit="shape", file=sys.stderr):
        single.run_method(target, method, warm_ids, 8)
    runs = single.benchmark(target, methods, prompts, args.max_new_tokens)
    names = [m.name for m in methods]
    summary = single.summarize(runs, names)
    table = single.markdown(summary)
    env = environment(args.threads)
    bundle = json.loads((path / "config.json").read_text())
    result = {
        "environment": env,
        "settings": {
            "drafter": args.drafter,
            "bundle": str(path),
            "training": bundle.get("training"),
            "shapes": [dict(zip(("width", "depth", "max_tree_nodes"), s, strict=True)) for s in args.shapes],
            "limit": args.limit,
            "max_new_tokens": args.max_new_tokens,
        },  # fmt: skip
        "summary": summary,
        "runs": [asdict(r) for r in runs],
    }
    header = (
        f"# Tree-shape sweep\n\n`{env['command']}`\n\n{env['date']}, {args.model} ({dtype}, cpu), {env['threads']} "
        f"threads of {env['cpu_count']} CPUs ({env['cpu']}); {args.drafter} under EAGLE-2 trees of width B, depth D, "
        f"at most m nodes; first {args.limit} MT-Bench + {args.limit} HumanEval prompts, greedy, "
        f"≤{args.max_new_tokens} new tokens. τ mean, tok/s median, speedup median of per-prompt ratios.\n\n"
    )
    single.plot(summary, args.out / "trees.png", f"{args.drafter}: EAGLE-2 tree shapes (B, D, m) on this CPU")
    return finish(args.out, "trees", result, header + table, table)


if __name__ == "__main__":
    sys.exit(main())
