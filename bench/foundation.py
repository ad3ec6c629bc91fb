"""Foundation benchmark: our decode loop against plain transformers on the real target, side by side.

Every method runs greedy on the same chat-templated prompts in one process, interleaved per prompt
(with the order rotated from prompt to prompt), so machine noise hits all methods alike:

* plain-local  our loop, no drafts, target in-process: what speculation has to beat
* pld-local    our loop with prompt lookup, target in-process
* pld-grpc     prompt lookup verified by a `splitspec serve` child on loopback: the cost of the wire
* api-grpc     the server's streaming Complete: the "just call an API" baseline
* hf-generate  transformers' greedy generate: the speed reference and the token-id reference
* hf-pld       transformers' own prompt lookup decoding (prompt_lookup_num_tokens=10)

tokens/s = new tokens / wall seconds of the whole call (prefill included), stopping at EOS.

Run:  .venv/bin/python -m bench.foundation [--limit K] [--max-new-tokens N] [--repeats R] [--methods a,b]
Writes foundation.json, foundation.md and foundation.png under --out (default bench/results).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from bench.common import cell, environment, finish, mark_differences, median, save_figure, start
from client.drafters import NoDrafter, PromptLookup
from client.loop.decode import Generation, generate
from client.net.api import api_complete
from client.net.connection import LinkCounters
from client.net.remote import RemoteVerifier
from client.verifiers import LocalVerifier
from shared.engine.models import encode_prompt, load_target
from shared.server_process import server_child

REPO = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m"
METHODS = ["plain-local", "pld-local", "pld-grpc", "api-grpc", "hf-generate", "hf-pld"]
REMOTE_METHODS = {"pld-grpc", "api-grpc"}
REFERENCE = "hf-generate"  # greedy ids of every method are checked against this one
BASELINES = ["plain-local", "hf-generate"]  # speedups are reported against these

# (kind, text): code prompts quote code the answer is likely to repeat (where prompt lookup helps),
# chat prompts mostly do not. Alternating kinds keeps --limit K balanced.
PROMPTS: list[tuple[str, str]] = [
    (
        "code",
        "Here is a function:\n\n```python\ndef total_even(values):\n    x = 0\n    for v in values:\n"
        "        if v % 2 == 0:\n            x += v\n    return x\n```\n\n"
        "Rename the variable x to count and return the full function.",
    ),
    ("chat", "What are three simple tips for getting better sleep?"),
    (
        "code",
        "Add type hints and a docstring to this function and return the full function:\n\n```python\n"
        "def find_user(users, name):\n    for user in users:\n        if user['name'] == name:\n"
        "            return user\n    return None\n```",
    ),
    ("chat", "Explain how photosynthesis works to a ten-year-old."),
    (
        "code",
        "Explain line by line what this code does:\n\n```python\ndef binary_search(items, target):\n"
        "    low, high = 0, len(items) - 1\n    while low <= high:\n        mid = (low + high) // 2\n"
        "        if items[mid] == target:\n            return mid\n        if items[mid] < target:\n"
        "            low = mid + 1\n        else:\n            high = mid - 1\n    return -1\n```",
    ),
    ("chat", "Write a short poem about the ocean at night."),
    (
        "code",
        "Refactor this loop into a list comprehension and show the complete code:\n\n```python\n"
        "squares = []\nfor number in range(20):\n    if number % 3 == 0:\n        squares.append(number * number)\n"
        "print(squares)\n```",
    ),
    ("chat", "What is the difference between a virus and a bacterium?"),
    (
        "code",
        "This function should return the average of a list but has a bug. Fix it and return the corrected "
        "function:\n\n```python\ndef average(numbers):\n    total = 0\n    for i in range(1, len(numbers)):\n"
        "        total += numbers[i]\n    return total / len(numbers)\n```",
    ),
    ("chat", "Give me a simple recipe for pancakes."),
]
WARMUP_PROMPT = "Say hello."

# A method takes (prompt ids, max new tokens) and returns (new token ids, extra stats).
Runner = Callable[[list[int], int], tuple[list[int], dict]]


@dataclass
class Run:
    """One timed generation: the raw numbers that go into the JSON."""

    prompt: int
    kind: str
    method: str
    repeat: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    finish_reason: str = ""
    acceptance_length: float | None = None
    rounds: int | None = None
    server_calls: int | None = None
    matches_reference: bool | None = None
    first_difference: int | None = None


def _our_stats(gen: Generation) -> dict:
    s = gen.stats
    return {
        "finish_reason": gen.finish_reason,
        "acceptance_length": round(s.acceptance_length, 4),
        "rounds": s.rounds,
        "server_calls": s.server_calls,
    }


def make_methods(names: list[str], target, remote: RemoteVerifier | None) -> dict[str, Runner]:
    """The runners for the chosen methods, in the chosen order."""

    def ours(verifier, new_drafter: Callable[[], object]) -> Runner:
        def run(prompt_ids: list[int], max_new: int) -> tuple[list[int], dict]:
            verifier.counters = LinkCounters()  # counters live on the verifier and add up across generations
            gen = generate(verifier, new_drafter(), prompt_ids, max_new)
            return gen.token_ids, _our_stats(gen)

        return run

    def api(prompt_ids: list[int], max_new: int) -> tuple[list[int], dict]:
        remote.counters = LinkCounters()
        gen = api_complete(remote, prompt_ids, max_new)
        return gen.token_ids, _our_stats(gen)

    def hf(**extra) -> Runner:
        def run(prompt_ids: list[int], max_new: int) -> tuple[list[int], dict]:
            ids = torch.tensor([prompt_ids], device=target.device)
            out = target.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False, **extra
            )
            new = out[0, len(prompt_ids) :].tolist()
            return new, {"finish_reason": "stop" if new[-1] in target.eos_token_ids else "length"}

        return run

    local = LocalVerifier(target)
    factories: dict[str, Callable[[], Runner]] = {
        "plain-local": lambda: ours(local, NoDrafter),
        "pld-local": lambda: ours(local, PromptLookup),
        "pld-grpc": lambda: ours(remote, PromptLookup),
        "api-grpc": lambda: api,
        "hf-generate": lambda: hf(),
        "hf-pld": lambda: hf(prompt_lookup_num_tokens=10),
    }
    return {name: factories[name]() for name in names}


def server_process(threads: int, workdir: Path, timeout_s: float = 300.0):
    """A `splitspec serve` child on a free loopback port (the demo's helper), pinned to ``threads``."""
    return server_child(["--threads", str(threads)], workdir, timeout_s)


def benchmark(
    methods: dict[str, Runner], prompts: list[tuple[str, list[int]]], max_new_tokens: int, repeats: int
) -> list[Run]:
    """Run every method on every prompt, interleaved, and check greedy ids against the reference."""
    names = list(methods)
    reference = REFERENCE if REFERENCE in methods else names[0]
    runs: list[Run] = []
    bar = tqdm(total=repeats * len(prompts) * len(names), desc="foundation", unit="run", file=sys.stderr)
    for repeat in range(repeats):
        for p, (kind, prompt_ids) in enumerate(prompts):
            shift = (p + repeat) % len(names)  # rotate so no method always runs first (or right after another)
            done: dict[str, tuple[Run, list[int]]] = {}
            for name in names[shift:] + names[:shift]:
                bar.set_postfix_str(f"prompt {p} {name}")
                start = time.perf_counter()
                ids, extra = methods[name](prompt_ids, max_new_tokens)
                wall = time.perf_counter() - start
                run = Run(p, kind, name, repeat, len(ids), round(wall, 4), round(len(ids) / wall, 3), **extra)
                done[name] = (run, ids)
                runs.append(run)
                bar.update()
            mark_differences(done, reference, f"prompt {p} repeat {repeat}")
    bar.close()
    return runs


def per_prompt_tps(runs: list[Run], method: str) -> dict[int, float]:
    """Median tokens/s over repeats, per prompt."""
    prompts = sorted({r.prompt for r in runs if r.method == method})
    return {p: statistics.median(r.tokens_per_s for r in runs if r.method == method and r.prompt == p) for p in prompts}


def summarize(runs: list[Run], names: list[str], kinds: list[str]) -> dict[str, dict]:
    """Per method: median tokens/s (all, code, chat), median per-prompt speedups, τ and mismatches."""
    tps = {m: per_prompt_tps(runs, m) for m in names}
    summary = {}
    for m in names:
        s: dict = {"median_tokens_per_s": median(list(tps[m].values()))}
        for kind in ("code", "chat"):
            s[f"median_tokens_per_s_{kind}"] = median([v for p, v in tps[m].items() if kinds[p] == kind])
        for base in BASELINES:
            ratios = [v / tps[base][p] for p, v in tps[m].items()] if base in tps else []
            s[f"median_speedup_vs_{base.replace('-', '_')}"] = median(ratios)
        s["median_acceptance_length"] = median(
            [r.acceptance_length for r in runs if r.method == m and r.acceptance_length is not None]
        )
        s["mismatches"] = sum(r.matches_reference is False for r in runs if r.method == m)
        s["runs"] = sum(r.method == m for r in runs)
        summary[m] = s
    return summary


def markdown(runs: list[Run], summary: dict[str, dict], kinds: list[str], reference: str) -> str:
    """The summary table, then tokens/s per prompt (median over repeats)."""
    lines = [
        f"| method | tok/s | code tok/s | chat tok/s | × plain-local | × hf-generate | τ | ≠ {reference} |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m, s in summary.items():
        cells = [
            cell(s["median_tokens_per_s"], ".2f"),
            cell(s["median_tokens_per_s_code"], ".2f"),
            cell(s["median_tokens_per_s_chat"], ".2f"),
            cell(s["median_speedup_vs_plain_local"], ".2f"),
            cell(s["median_speedup_vs_hf_generate"], ".2f"),
            cell(s["median_acceptance_length"], ".2f"),
            "–" if m == reference else f"{s['mismatches']}/{s['runs']}",
        ]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    names = list(summary)
    tps = {m: per_prompt_tps(runs, m) for m in names}
    tokens = {r.prompt: r.tokens for r in runs if r.method == reference}
    lines += [
        "",
        f"| prompt | kind | tokens ({reference}) | " + " | ".join(names) + " |",
        "|---:|---|---:|" + "---:|" * len(names),
    ]
    for p in sorted(tokens):
        row = " | ".join(cell(tps[m].get(p), ".2f") for m in names)
        lines.append(f"| {p} | {kinds[p]} | {tokens[p]} | {row} |")
    return "\n".join(lines)


def plot(runs: list[Run], summary: dict[str, dict], kinds: list[str], path: Path, title: str) -> None:
    """Bars of median tokens/s per method with each prompt's value on top, so the spread shows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    fig, ax = plt.subplots(figsize=(9, 4.8))
    ax.bar(range(len(names)), [summary[m]["median_tokens_per_s"] for m in names], color="#9ecae1", label="median")
    markers = {"code": ("o", "#d95f02"), "chat": ("s", "#1b9e77")}
    for x, m in enumerate(names):
        tps = per_prompt_tps(runs, m)
        for i, (p, v) in enumerate(tps.items()):
            marker, color = markers[kinds[p]]
            offset = (i / max(len(tps) - 1, 1) - 0.5) * 0.5  # spread the points across the bar
            ax.scatter(x + offset, v, marker=marker, color=color, s=18, zorder=3)
    for kind, (marker, color) in markers.items():
        ax.scatter([], [], marker=marker, color=color, s=18, label=f"{kind} prompt")
    ax.set_xticks(range(len(names)), names, rotation=15)
    ax.set_ylabel("tokens/s (new tokens / wall s)")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--limit", type=int, default=len(PROMPTS), help=f"first K prompts (default all {len(PROMPTS)})")
    p.add_argument("--max-new-tokens", type=int, default=128, help="token budget per generation (default 128)")
    p.add_argument("--repeats", type=int, default=1, help="times each (prompt, method) runs (default 1)")
    p.add_argument("--threads", type=int, default=2, help="torch threads, here and in the server (default 2)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results", help="output folder")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma list (default {','.join(METHODS)})")
    args = p.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown or not args.methods:
        p.error(f"unknown or no methods {unknown}; choose from {', '.join(METHODS)}")
    for name in ("limit", "max_new_tokens", "repeats", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start(args.threads)
    target = load_target(MODEL)
    chosen = PROMPTS[: args.limit]
    prompts = [(kind, encode_prompt(target.tokenizer, text, chat=True)) for kind, text in chosen]
    kinds = [kind for kind, _ in chosen]
    reference = REFERENCE if REFERENCE in args.methods else args.methods[0]

    with tempfile.TemporaryDirectory(prefix="splitspec-bench-") as tmp:
        needs_server = bool(REMOTE_METHODS & set(args.methods))
        with server_process(args.threads, Path(tmp)) if needs_server else nullcontext(None) as address:
            # the default 120 s deadline covers a whole Complete stream, too short for long budgets
            timeout = max(120.0, 2.0 * args.max_new_tokens)
            remote = RemoteVerifier(address, fingerprint=target.fingerprint, rpc_timeout_s=timeout) if address else None
            try:
                methods = make_methods(args.methods, target, remote)
                warm_ids = encode_prompt(target.tokenizer, WARMUP_PROMPT, chat=True)
                for run in tqdm(methods.values(), desc="warm-up", unit="method", file=sys.stderr):
                    run(warm_ids, 8)  # first calls pay one-off costs (allocator, gRPC channel, HF setup)
                runs = benchmark(methods, prompts, args.max_new_tokens, args.repeats)
            finally:
                if remote is not None:
                    remote.shutdown()

    env = environment(args.threads)
    summary = summarize(runs, args.methods, kinds)
    table = markdown(runs, summary, kinds, reference)
    settings = {
        "model": MODEL,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "methods": args.methods,
        "reference": reference,
        "greedy": True,
        "prompts": [
            {"index": i, "kind": kind, "prompt_tokens": len(ids), "text": text}
            for i, ((kind, text), (_, ids)) in enumerate(zip(chosen, prompts, strict=True))
        ],
    }
    mismatches = sum(s["mismatches"] for s in summary.values())
    result = {"environment": env, "settings": settings, "summary": summary, "mismatches": mismatches}
    result["runs"] = [asdict(r) for r in runs]
    header = (
        f"# Foundation benchmark\n\n`{env['command']}`\n\n{env['date']}, torch {env['torch']}, "
        f"transformers {env['transformers']}, {env['threads']} threads of {env['cpu_count']} CPUs ({env['cpu']}); "
        f"{len(prompts)} prompts × {args.repeats} repeats, greedy, ≤{args.max_new_tokens} new tokens, stop at EOS.\n"
        f"tok/s and speedups are medians over prompts (each prompt: median over repeats); τ = tokens per "
        f"verification round; ≠ counts runs whose token ids differ from {reference}.\n\n"
    )
    title = f"{MODEL}, {args.threads} threads, {len(prompts)} prompts, ≤{args.max_new_tokens} new tokens, greedy"
    plot(runs, summary, kinds, args.out / "foundation.png", title)
    notes = [f"WARNING: {mismatches} run(s) produced token ids different from {reference}"] if mismatches else []
    return finish(args.out, "foundation", result, header + table, table, notes)


if __name__ == "__main__":
    sys.exit(main())
