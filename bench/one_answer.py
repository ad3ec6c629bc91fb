"""One model, one answer, checked as a user would: with the CLI's defaults only, on held-out prompts, does every way
of running the target give the same tokens?

Per prompt (MT-Bench first turns and HumanEval stubs, as chat messages, greedy): ``splitspec generate --local`` with
``--drafter none`` and with each drafter, then a ``splitspec serve`` child (defaults only) and ``generate --server``
with the streaming API (``--baseline api``), ``--drafter none`` and each drafter in ``--mode draft``. The clients run
in this process through the CLI's own ``main`` (a model drafter is loaded once); the server is a real child. Each
command's token ids are compared with ``generate --local --drafter none``'s and their md5 is tabulated.

Run:  .venv/bin/python -m bench.one_answer [--model M] [--drafters a,b] [--limit K] [--max-new-tokens N]
Writes one-answer.json and one-answer.md under --out (default bench/results/one-answer).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

from bench.common import drop_unusable, environment, finish, served_target, skipped_note, start
from bench.single import HUMANEVAL_TEMPLATE
from client.training.datasets import humaneval_problems, mtbench_questions
from shared.cli import main
from shared.engine.models import DEFAULT_MODEL
from shared.server_process import server_child

REPO = Path(__file__).resolve().parents[1]
DRAFTERS = "prompt-lookup,eagle,independent,medusa,moa-tli0,moa-tli1,moa-tli3"


def prompts(limit: int) -> list[tuple[str, str]]:
    """(id, text): the first ``limit`` of each dataset, alternated; neither is in any drafter's training data."""
    mt = [(f"mt-bench/{q['question_id']}", q["turns"][0]) for q in mtbench_questions()[:limit]]
    he = [(p["task_id"], HUMANEVAL_TEMPLATE.format(prompt=p["prompt"])) for p in humaneval_problems()[:limit]]
    return [x for pair in zip(mt, he, strict=True) for x in pair]


def generate(args: argparse.Namespace, text: str, *options: str) -> list[int]:
    """The ids `splitspec generate ... --json` prints for ``text`` (only ``options`` and the budget beside the
    defaults), run in this process."""
    out = io.StringIO()
    argv = ["generate", "--model", args.model, "--chat", "--prompt", text, "--max-new-tokens",
            str(args.max_new_tokens), "--json", *options]  # fmt: skip
    with contextlib.redirect_stdout(out):
        code = main(argv)
    if code:
        raise SystemExit(f"splitspec {' '.join(argv[:3])} ... {' '.join(options)} exited {code}")
    return json.loads(out.getvalue())["token_ids"]


def md5(ids: list[int]) -> str:
    return hashlib.md5(json.dumps(ids).encode()).hexdigest()[:8]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"the target (default {DEFAULT_MODEL})")
    p.add_argument("--drafters", default=DRAFTERS, help=f"comma list (default {DRAFTERS})")
    p.add_argument("--limit", type=int, default=2, help="prompts of each dataset (default 2)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="token budget per generation (default 64)")
    p.add_argument("--threads", type=int, default=2, help="torch threads here and in the server (default 2)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "one-answer", help="output folder")
    args = p.parse_args(argv)
    args.drafters = [d.strip() for d in args.drafters.split(",") if d.strip()]
    if args.limit < 1 or args.max_new_tokens < 1:
        p.error("--limit and --max-new-tokens must be >= 1")
    return args


def run(args: argparse.Namespace) -> dict:
    target, _ = served_target(args.model)  # which drafters can draft for it (a bundle made for another is skipped)
    args.drafters, skipped = drop_unusable(args.drafters, target, lambda d: d)
    del target
    local = [("local", d, ("--local", "--drafter", d)) for d in ["none", *args.drafters]]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp, \
            server_child(["--model", args.model, "--threads", str(args.threads)], Path(tmp)) as address:
        remote = [("server", "api", ("--server", address, "--baseline", "api"))]
        remote += [("server", d, ("--server", address, "--drafter", d, "--mode", "draft"))
                   for d in ["none", *args.drafters]]  # fmt: skip
        commands = local + remote
        with tqdm(total=len(commands) * 2 * args.limit, desc="generations", file=sys.stderr) as bar:
            for pid, text in prompts(args.limit):
                plain = None
                for where, drafter, options in commands:
                    ids = generate(args, text, *options)
                    plain = ids if plain is None else plain
                    rows.append({"prompt": pid, "where": where, "drafter": drafter, "tokens": len(ids),
                                 "md5": md5(ids), "equal": ids == plain})  # fmt: skip
                    bar.update()
    return {"rows": rows, "commands": [" ".join(o) for _, _, o in commands], "skipped": skipped}


def markdown(result: dict, args: argparse.Namespace) -> str:
    rows = result["rows"]
    keys = list(dict.fromkeys((r["where"], r["drafter"]) for r in rows))
    pids = list(dict.fromkeys(r["prompt"] for r in rows))
    by = {(r["prompt"], r["where"], r["drafter"]): r for r in rows}
    env = result["environment"]
    lines = [f"# One model, one answer: {args.model}, defaults only, greedy, {args.max_new_tokens} new tokens\n",
             f"{env['cpu']}, {env['threads']} threads, {env['date']}; cells: tokens, md5 of the ids "
             "(=: equal to `--local --drafter none`)\n", skipped_note(result.get("skipped", {})),
             "| where | drafter | " + " | ".join(pids) + " | equal |", "|---|---" + "|---" * (len(pids) + 1) + "|"]
    for where, drafter in keys:
        cells = [by[p, where, drafter] for p in pids]
        lines.append(f"| {where} | {drafter} | " + " | ".join(
            f"{c['tokens']} {c['md5']}{' =' if c['equal'] else ' ≠'}" for c in cells)
            + f" | {sum(c['equal'] for c in cells)}/{len(cells)} |")  # fmt: skip
    equal = sum(r["equal"] for r in rows)
    lines.append(f"\n**{equal} of {len(rows)}** generations equal `generate --local --drafter none`.")
    return "\n".join(lines)


def cli(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start(args.threads)
    result = {"environment": environment(args.threads), "settings": {k: str(v) for k, v in vars(args).items()},
              **run(args)}  # fmt: skip
    return finish(args.out, "one-answer", result, markdown(result, args), png=False)


if __name__ == "__main__":
    sys.exit(cli())
