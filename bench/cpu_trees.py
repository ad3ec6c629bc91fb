"""Trees on this CPU against their targets: every measurement issue 65 asks for, in one run, and one table.

What drafting can gain on a CPU rests on a few numbers: what a tree of 17 tokens costs against one token on the
1.5B, plain decoding beside llama.cpp on the same GGUF, the pair's speed-ups ``--local`` and split over 4g, and that
every drafter on every path still gives plain decoding's tokens. Each is its own benchmark; this runs them one after
another, a folder each under ``--out``, and reads their JSON into ``cpu-trees.{json,md}``: each target, the figure
measured here, and whether it is met, for this CPU's kind (the targets differ by kind).

Steps (``--steps``, default all; a step whose JSON is already under ``--out`` is not run again unless ``--again``,
so an interrupted run resumes where it stopped):

* ``engine``   ``bench.engine`` on the 1.5B: a forward of 1-33 tokens after a 128-token prefix (17 ÷ 1), the trees'
               int8 multiply-adds against the peak, plain decoding against the memory's read rate, llama.cpp's
               forwards beside ours when ``--llama-bench`` names its binary;
* ``plain``    ``bench.single``'s rounds alternating llama-bench and our plain decoding (with ``--llama-bench``);
* ``local``    ``bench.single`` on the pair, ``--local`` under the adaptive policy: none, prompt lookup (the default
               drafter), the 0.5B and the 0.5B+lookup on MT-Bench and HumanEval;
* ``network``  ``bench.network`` over 4g, a core each: the API, the 0.5B in mode draft, the 0.5B+lookup in mode auto;
* ``paths``    ``bench.engine`` on the 135M: every drafter on every path this CPU runs (every kernel build).

Run:  .venv/bin/python -m bench.cpu_trees [--llama-bench PATH] [--steps engine,local] [--quick] [--out DIR]
      (``make bench-cpu-trees``; ~25 min on 2 cores; ``--quick``: fewer prompts and tokens, ~8 min, a rehearsal)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from bench.common import environment, finish
from shared.engine import kernels

PAIR = "qwen2.5-coder-1.5b"
DRAFTER = "qwen2.5-coder-0.5b"
STEPS = ("engine", "plain", "local", "network", "paths")
# (what, the JSON a step writes)
OUTPUTS = {"engine": "engine.json", "plain": "single.json", "local": "single.json", "network": "network.json",
           "paths": "engine.json"}  # fmt: skip
# issue 65's targets a kind at a time: 17 tokens ÷ 1 at most, the 0.5B --local on code at least, 4g mode draft on
# code ÷ the API at least (None: no target for that kind)
TARGETS = {
    "Intel with AMX": {"tree": 1.2, "local_code": None, "network_code": None},
    "AMD Zen 5 kind (AVX-512 VNNI and AVX-VNNI)": {"tree": 1.8, "local_code": 1.8, "network_code": 1.5},
    "AMD Zen 4 kind (AVX-512 VNNI, no AVX-VNNI)": {"tree": 3.0, "local_code": None, "network_code": None},
    "AVX2-only kind (\"Zen 3\")": {"tree": 3.0, "local_code": 1.2, "network_code": None},
}
PLAIN_VS_LLAMA = 1.1  # plain decoding ÷ llama.cpp's, on every kind
CHAT = 1.0  # the default drafter (prompt lookup) on chat ÷ plain decoding, on every kind


def kind(flags: set[str]) -> str:
    """Which of the project's CPU kinds this is, by its flags (what sets the kernels' speed, not the model name)."""
    if {"amx_tile", "amx_int8"} <= flags:
        return "Intel with AMX"
    if "avx512_vnni" in flags:
        return "AMD Zen 5 kind (AVX-512 VNNI and AVX-VNNI)" if "avx_vnni" in flags else (
            "AMD Zen 4 kind (AVX-512 VNNI, no AVX-VNNI)")  # fmt: skip
    if "avx2" in flags and "avx512f" not in flags:
        return "AVX2-only kind (\"Zen 3\")"
    return "another kind (no per-kind targets)"


def commands(py: str, out: Path, llama: str | None, gguf: str | None, quick: bool) -> dict[str, list[str] | None]:
    """Each step's command line (None: it cannot run here, e.g. ``plain`` without llama-bench)."""
    prompts, tokens = (1, 48) if quick else (2, 128)
    llama_args = ["--llama-bench", llama, "--gguf", gguf] if llama and gguf else []
    paths = ["fp32", "fp32+int8", "fp32+int4", "bf16"] + [f"fp32+int4@{b}" for b in kernels.builds() if b != "portable"]
    return {
        "engine": [py, "-m", "bench.engine", "--model", PAIR, "--dtypes", "fp32+lowbit", "--sizes", "1,5,9,17,24,33",
                   "--prefix", "128", "--repeats", "5" if quick else "9", "--prompts", str(prompts),
                   "--max-new-tokens", str(tokens // 2), "--drafters", "none", *llama_args,
                   "--out", str(out / "engine")],
        "plain": None if not llama else [
            py, "-m", "bench.single", "--model", PAIR, "--drafters", "none", "--limit", "1", "--max-new-tokens",
            str(tokens), "--llama-bench", llama, "--llama-speculative=", "--llama-rounds", "3" if quick else "7",
            "--out", str(out / "plain")],
        "local": [py, "-m", "bench.single", "--model", PAIR, "--drafters",
                  f"none,prompt-lookup,{DRAFTER},{DRAFTER}+lookup", "--adaptive", "--limit", str(prompts),
                  "--max-new-tokens", str(tokens), "--llama-bench=", "--llama-speculative=",
                  "--out", str(out / "local")],
        "network": [py, "-m", "bench.network", "--model", PAIR, "--profiles", "4g", "--methods",
                    f"api,{DRAFTER}-adaptive,{DRAFTER}+lookup-auto", "--limit", str(prompts), "--max-new-tokens",
                    str(tokens * 3 // 4), "--out", str(out / "network")],
        "paths": [py, "-m", "bench.engine", "--model", "smollm2-135m", "--dtypes", ",".join(paths), "--drafters",
                  "prompt-lookup,eagle,medusa,moa-tli1", "--prompts", str(prompts), "--max-new-tokens",
                  str(tokens // 2 if quick else 128), "--sizes", "1,17", "--repeats", "3",
                  "--out", str(out / "paths")],  # tokens, not timings: the forward table kept short
    }  # fmt: skip


def load(out: Path, step: str) -> dict | None:
    path = out / step / OUTPUTS[step]
    return json.loads(path.read_text()) if path.is_file() else None


def verdict(value: float | None, target: float | None, at_most: bool = False) -> str:
    if value is None:
        return "not measured"
    if target is None:
        return "no target for this kind"
    return "**met**" if (value <= target if at_most else value >= target) else "not met"


def floor(engine: dict) -> float | None:
    """The least 17 ÷ 1 this CPU allows: one token no faster than its weights' bytes at the memory's read rate, 17
    no faster than their layers' multiply-adds at the build's multiply instruction's peak (attention and the head
    left out, so a bound below what any kernel reaches). None where the engine step lacks a figure."""
    rates = next(iter(engine.get("int8_rates", {}).values()), None)
    memory = engine.get("memory", {})
    read, gb = memory.get("read_gb_per_s", {}).get("forward"), next(iter(memory.get("gb_per_token", {}).values()), None)
    if not (rates and rates.get("peak_g_per_s") and read and gb):
        return None
    one = gb / read
    return max(one, 17 * rates["g_macs_per_token"] / rates["peak_g_per_s"]) / one


def targets(cpu_kind: str, results: dict[str, dict | None]) -> list[dict]:
    """Issue 65's targets for ``cpu_kind``, each with the figure measured (None: its step did not run)."""
    goal = TARGETS.get(cpu_kind, {"tree": None, "local_code": None, "network_code": None})
    rows = []
    engine = results.get("engine")
    tree = None
    if engine:
        ms = {r["n"]: r["ms"] for r in engine["forward"] if r["engine"] == "splitspec tree"}
        tree = ms[17] / ms[1] if 1 in ms and 17 in ms else None
    reads = (engine or {}).get("memory", {}).get("read_gb_per_s", {})
    note = ""
    if reads.get("forward"):
        note = (f"memory read {reads['forward']:.1f} GB/s before the forwards: one token is bound by the memory, "
                "17 by the multiplies")
        if (least := floor(engine)) is not None:
            note += f"; that rate and the multiply instruction's peak allow ≥ {least:.2f}×"
    rows.append({"target": "17 tokens ÷ 1 token, the 1.5B as a tree", "measured": tree, "goal": goal["tree"],
                 "at_most": True, "note": note})
    side = ((results.get("plain") or {}).get("llama_cpp") or {}).get("plain_side_by_side")
    rows.append({"target": "plain decoding ÷ llama.cpp's, side by side", "measured": side and side["median_ratio"],
                 "goal": PLAIN_VS_LLAMA, "note": "both stream the same weights; see the rounds' shares of the memory's "
                 "read rate" if side else ""})  # fmt: skip
    local = (results.get("local") or {}).get("summary", {})

    def speedup(method: str, dataset: str) -> float | None:
        return local.get(method, {}).get(dataset, {}).get("median_speedup")

    rows.append({"target": f"the {DRAFTER} --local on code (HumanEval) ÷ plain",
                 "measured": speedup(DRAFTER, "humaneval"), "goal": goal["local_code"], "note": ""})
    rows.append({"target": "the default drafter (prompt lookup) on chat (MT-Bench) ÷ plain",
                 "measured": speedup("prompt-lookup", "mt-bench"), "goal": CHAT,
                 "note": f"the {DRAFTER}: {speedup(DRAFTER, 'mt-bench'):.2f}×" if speedup(DRAFTER, "mt-bench") else ""})
    api = ((results.get("network") or {}).get("against_api") or {}).get("4g", {}).get("humaneval", {})
    mode_draft = api.get(f"{DRAFTER}-adaptive", {}).get("speed_vs_api")
    auto = api.get(f"{DRAFTER}+lookup-auto", {}).get("speed_vs_api")
    rows.append({"target": f"4g, a core each: the {DRAFTER} in mode draft on code ÷ the API", "measured": mode_draft,
                 "goal": goal["network_code"], "note": f"the {DRAFTER}+lookup in mode auto: {auto:.2f}×" if auto
                 else ""})  # fmt: skip
    paths = results.get("paths")
    differ = None
    if paths:
        differ = sum((r["differ_from_plain"] or 0) + (r["differ_from_hf"] or 0) for r in paths["decode"].values())
    rows.append({"target": "every drafter on every path gives plain decoding's tokens (prompts that differ)",
                 "measured": differ, "goal": 0, "at_most": True, "count": True,
                 "note": f"{len(paths['decode'])} rows, fp32 against transformers' generate too" if paths else ""})
    for r in rows:
        r["verdict"] = verdict(r["measured"], r["goal"], r.get("at_most", False))
    return rows


def figure(value: float | None, count: bool = False) -> str:
    """A ratio as ``1.23×``, a count as it is, nothing measured as a dash."""
    return "–" if value is None else str(value) if count else f"{value:.2f}×"


def markdown(result: dict) -> str:
    env = result["environment"]
    lines = ["# Trees on this CPU against issue 65's targets\n",
             f"`{env['command']}`\n",
             f"{env['date']}, {env['cpu']}, {env['cpu_count']} CPUs, kernels {env.get('kernels')}: "
             f"**{result['kind']}**. "
             "Each figure comes from its step's own results below (their commands, tables and checks)."
             + (" **A rehearsal** (`--quick`: fewer prompts, tokens and repeats), not a result." if result.get("quick")
                else "") + "\n",
             "| target | measured | goal | verdict | note |", "|---|---:|---:|---|---|"]  # fmt: skip
    for r in result["targets"]:
        count = r.get("count", False)
        goal = "–" if r["goal"] is None else f"{'≤' if r.get('at_most') else '≥'} {figure(r['goal'], count)}"
        lines.append(f"| {r['target']} | {figure(r['measured'], count)} | {goal} | {r['verdict']} | {r['note']} |")
    lines += ["", "Steps:\n"]
    for step, state in result["steps"].items():
        where = step if state.startswith("not run") else f"[{step}]({step}/{OUTPUTS[step].replace('.json', '.md')})"
        lines.append(f"* {where}: {state}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma list of {', '.join(STEPS)}")
    p.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH"),
                   help="llama-bench binary: llama.cpp beside ours (default $LLAMA_BENCH; `make llama-bench`)")
    p.add_argument("--gguf", default=None, help="the 1.5B's GGUF for llama.cpp (default: the one `make pair` pulled)")
    p.add_argument("--quick", action="store_true", help="fewer prompts, tokens and repeats: a rehearsal, not a result")
    p.add_argument("--again", action="store_true", help="run steps whose results are already under --out")
    p.add_argument("--out", type=Path, default=Path("bench/results/cpu-trees"))
    args = p.parse_args(argv)
    bad = sorted(set(args.steps.split(",")) - set(STEPS))
    if bad:
        p.error(f"unknown step(s) {', '.join(bad)}: expected some of {', '.join(STEPS)}")
    if args.llama_bench and not Path(args.llama_bench).is_file():
        p.error(f"--llama-bench {args.llama_bench}: no such file (`make llama-bench` builds one)")
    return args


def main(argv: list[str] | None = None) -> int:
    from shared.engine.gguf import source_of
    from shared.engine.models import resolve_model

    args = parse_args(argv)
    gguf = args.gguf or (str(source_of(resolve_model(PAIR))) if args.llama_bench else None)
    lines = commands(sys.executable, args.out, args.llama_bench, gguf, args.quick)
    steps = {}
    for step in STEPS:
        if step not in args.steps.split(","):
            steps[step] = "kept from an earlier run" if load(args.out, step) else "not run"
            continue
        if lines[step] is None:
            steps[step] = "not run: needs --llama-bench"
            continue
        if load(args.out, step) and not args.again:
            steps[step] = "kept from an earlier run (--again runs it anew)"
            continue
        print(f"== {step}: {' '.join(lines[step])}", file=sys.stderr, flush=True)
        code = subprocess.run(lines[step]).returncode
        steps[step] = "ran" if code == 0 else f"failed (exit {code})"
    results = {step: load(args.out, step) for step in STEPS}
    cpu_kind = kind(kernels.cpu_flags())
    result = {"environment": environment(2), "kind": cpu_kind, "quick": args.quick, "steps": steps,
              "targets": targets(cpu_kind, results)}  # fmt: skip
    md = markdown(result)
    finish(args.out, "cpu-trees", result, md, png=False)
    return 0 if all(not s.startswith("failed") for s in steps.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
