"""Single-device drafter benchmark: each drafter on MT-Bench and HumanEval, target in-process (MoA paper, Table 2).

One process, greedy, ``--local`` (the target verifies through ``client.verifiers.LocalVerifier``): what each
drafter buys before any network is involved. Prompts:

* MT-Bench   the first turn of each of its 80 questions, as a chat user message
* HumanEval  each of its 164 function stubs, wrapped as the user message
             "Complete this Python function:\\n\\n```python\\n{prompt}```". SmolLM2-135M-Instruct is a chat
             model: fed the bare stub through its chat template it tends to chat about the code instead of
             writing it, and the MoA paper evaluates chat-tuned targets the same way (an instruction, then
             the code). The stub is quoted whole, so the answer repeats much of the prompt, as code answers do.

Methods (``--drafters``): ``none`` (plain decoding through the same loop: the baseline and the reference for
greedy ids), ``prompt-lookup`` (training-free) and trained drafters, each loaded from a bundle
(``--bundle-dir DIR/<name>`` first, then the shipped ``client/drafters/bundles/<name>``). A trained drafter
without a bundle is skipped with a warning and listed under ``skipped`` in the JSON. Trained drafters draft
EAGLE-2 dynamic trees of ``--tree-width`` B, ``--tree-depth`` D and at most ``--max-tree-nodes`` nodes; prompt
lookup drafts its own chain (≤10 nodes) whatever those flags say. ``--draft-vocabs 8k,16k,24k,full`` runs each
trained drafter once per draft vocabulary (``eagle@8k``, ...): its head is the target's frozen LM head cut to the
N most frequent assistant tokens, so one bundle serves every size (trained against its own size's KL: the other
sizes measure what the head's cost and the vocabulary's coverage do to speed and τ, not a drafter trained for them).
``--drafter-weights int8,int4`` likewise runs each trained drafter once per setting of its own layers' weights,
and a model drafter once per path.

Every method runs on every prompt, interleaved per prompt with the order rotated from prompt to prompt (and
the two datasets alternated), so machine noise hits all methods alike. Per prompt: tokens/s = new tokens /
wall seconds of the whole call (prefill included, stopping at EOS as the decode loop does), decode tokens/s the
same after the first token (the prompt's prefill apart: the pace llama.cpp prints), τ = tokens gained
per verification round (accepted drafts + the bonus token), rounds, drafting seconds, and whether the token
ids equal ``none``'s (greedy must give the same ids; a floating-point tie may rarely flip one: counted and
reported, never fatal). Per (method, dataset): median tokens/s, mean τ over prompts, speedup = median over
prompts of (method tok/s / none tok/s on that prompt), and the mismatch count.

Run:  .venv/bin/python -m bench.single [--limit K] [--max-new-tokens N] [--drafters a,b] [--bundle-dir DIR]
Writes single.json, single.md and single.png under --out (default bench/results).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from bench.common import (
    Timed,
    cell,
    environment,
    finish,
    mark_differences,
    median,
    save_figure,
    skipped_note,
    start,
    stream_bytes,
    times,
)
from client.drafters import ALIASES, DRAFTERS, NoDrafter, is_model, make_drafter
from client.loop.decode import Settings, generate
from client.training.datasets import humaneval_problems, mtbench_questions
from client.verifiers import LocalVerifier
from shared.acceptance import ACCEPTANCE, SamplingParams
from shared.bundles import read_bundle
from shared.engine.decoder import DTYPES
from shared.engine.models import DEFAULT_MODEL, encode_prompt, load_target
from shared.errors import SplitspecError

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DRAFTERS = ["none", "prompt-lookup", "eagle", "medusa", "independent", "moa-tli0", "moa-tli1", "moa-tli3"]
REFERENCE = "none"  # speedups and greedy ids are measured against plain decoding through the same loop
DATASETS = ["mt-bench", "humaneval"]
HUMANEVAL_TEMPLATE = "Complete this Python function:\n\n```python\n{prompt}```"
UNTRAINED_MAX_TREE_NODES = 64  # the decode loop's default; prompt lookup never drafts that many
WARMUP_PROMPT = "Say hello."
LLAMA = "llama.cpp"  # the prefix of llama.cpp's rows


@dataclass
class Prompt:
    dataset: str
    index: int  # position within its dataset
    id: str  # MT-Bench question_id or HumanEval task_id
    text: str
    ids: list[int]


@dataclass
class Run(Timed):
    """One timed generation in process: the raw numbers that go into the JSON."""

    draft_s: float
    finish_reason: str
    matches_reference: bool | None = None
    first_difference: int | None = None
    decode_tokens_per_s: float | None = None  # after the first token: decoding's pace, the prompt's prefill apart


@dataclass
class Method:
    name: str
    drafter: object
    max_tree_nodes: int
    bundle: dict | None = None  # a trained drafter's bundle config (its "training" budget among it)
    vocabulary: tuple[str, float] | None = None  # --draft-vocabs: (size label, share of assistant tokens covered)
    sampling: SamplingParams = field(default_factory=SamplingParams)  # --temperature, --acceptance (seed per prompt)
    adaptive: bool = False  # --adaptive: under the adaptive policy, as `generate --local` runs by default
    policy: object = None  # --adaptive: the policy of this method's latest run, which the next one starts from


def load_prompts(tokenizer, limit: int | None) -> list[Prompt]:
    """The first ``limit`` prompts of each dataset, alternated (mt-bench 0, humaneval 0, mt-bench 1, ...)."""
    mt = [(str(q["question_id"]), q["turns"][0]) for q in mtbench_questions()]
    he = [(p["task_id"], HUMANEVAL_TEMPLATE.format(prompt=p["prompt"])) for p in humaneval_problems()]
    per_dataset = {
        name: [
            Prompt(name, i, pid, text, encode_prompt(tokenizer, text, chat=True)) for i, (pid, text) in enumerate(items)
        ]
        for name, items in zip(DATASETS, (mt[:limit], he[:limit]), strict=True)
    }
    longest = max(len(v) for v in per_dataset.values())
    return [ps[i] for i in range(longest) for ps in per_dataset.values() if i < len(ps)]


def bundle_path(name: str, bundle_dir: Path | None, target=None) -> Path | None:
    """A trained drafter's bundle: ``bundle_dir/name`` first, then what ``find_bundle`` finds (the one trained for
    ``target`` where several targets have one of that name); None if nowhere."""
    from client.drafters.bundle import find_bundle

    if bundle_dir is not None and (bundle_dir / name / "config.json").is_file():
        return bundle_dir / name
    return find_bundle(name, target)


def make_methods(names: list[str], target, args: argparse.Namespace) -> tuple[list[Method], dict[str, str]]:
    """The drafters that can run, in the chosen order, and {name: why} for those skipped."""
    methods, skipped = [], {}
    counts: dict[tuple[int, int], Counter[int]] = {}  # assistant-token counts per (seq_len, seed), for --draft-vocabs
    for name in names:
        if ALIASES.get(name, name) in DRAFTERS:
            methods.append(Method(name, make_drafter(name), UNTRAINED_MAX_TREE_NODES))
            continue
        if is_model(name):  # a whole model sharing the target's tokenizer, once per --drafter-weights
            for weights in args.drafter_weights:
                drafter = make_drafter(name, target=target, width=args.tree_width, depth=args.tree_depth,
                                       device=args.device, weights=weights)  # fmt: skip
                label = name if len(args.drafter_weights) == 1 else f"{name}@{weights}"
                methods.append(Method(label, drafter, args.max_tree_nodes))
            continue
        path = bundle_path(name, args.bundle_dir, target)
        if path is None:
            where = f"{args.bundle_dir / name} nor " if args.bundle_dir else ""
            skipped[name] = f"no bundle: neither {where}a shipped bundle client/drafters/bundles/{name} exists"
            print(f"WARNING: skipping {name}: {skipped[name]} (train one, or pass --bundle-dir)", file=sys.stderr)
            continue
        try:  # a bundle of that name trained for another target (the 1.5B's, on the 0.5B) cannot apply: skip it
            config = {**read_bundle(path, target), "path": str(path)}
        except SplitspecError as exc:
            skipped[name] = str(exc)
            print(f"WARNING: skipping {name}: {exc}", file=sys.stderr)
            continue
        for label, vocab_ids, coverage in draft_vocabularies(args.draft_vocabs, target, config, counts):
            for weights in args.drafter_weights:
                drafter = make_drafter(str(path), target=target, width=args.tree_width, depth=args.tree_depth,
                                       weights=weights, vocab_ids=vocab_ids)  # fmt: skip
                vocabulary = (label, coverage) if label else None
                labels = [x for x in (label, "" if len(args.drafter_weights) == 1 else weights) if x]
                methods.append(Method("@".join([name, *labels]), drafter, args.max_tree_nodes, config,
                                      vocabulary))  # fmt: skip
    return with_rules(methods, args), skipped


def with_rules(methods: list[Method], args: argparse.Namespace) -> list[Method]:
    """Each method at ``--temperature`` under each ``--acceptance`` rule (named "<method> <rule>" but for exact;
    the reference, plain decoding, has nothing to accept and runs once)."""
    out = []
    for rule in args.acceptance:
        for m in methods:
            if rule != "exact" and m.name == REFERENCE:
                continue
            sampling = SamplingParams(temperature=args.temperature, acceptance=rule)
            out.append(replace(m, name=m.name if rule == "exact" else f"{m.name} {rule}", sampling=sampling))
    return out


def draft_vocabularies(sizes: list[int], target, config: dict, counts: dict
                       ) -> list[tuple[str, torch.Tensor | None, float]]:  # fmt: skip
    """(label, vocab_ids, coverage) per size of ``--draft-vocabs`` for one bundle: its own vocabulary when none
    are asked for; else the most frequent tokens counted as its training counted them (same sequence length and
    seed, counted once into ``counts``; at the bundle's own size, exactly its vocabulary), 0 for the target's
    whole vocabulary."""
    if not sizes:
        return [("", None, 1.0)]
    from client.training.vocab import draft_vocab, token_counts

    training = config.get("training") or {}
    key = (training.get("seq_len", 512), training.get("seed", 0))
    if key not in counts:
        print(f"counting assistant tokens (seq_len {key[0]}, seed {key[1]}) for --draft-vocabs ...", file=sys.stderr)
        counts[key] = token_counts(target.tokenizer, seq_len=key[0], seed=key[1])
    vocabularies = []
    for size in sizes:
        if size == 0 or size >= target.vocab_size:
            vocabularies.append(("full", torch.empty(0, dtype=torch.long), 1.0))
            continue
        ids, coverage = draft_vocab(target.tokenizer, size, counts=counts[key])
        label = f"{size // 1024}k" if size % 1024 == 0 else str(size)
        vocabularies.append((label, None if size == config.get("draft_vocab_size") else ids, round(coverage, 5)))
    return vocabularies


def gguf_of(name: str) -> str | None:
    """The GGUF file behind a model name (a built-in GGUF model or a path), for llama.cpp; None if there is none."""
    from shared.engine import gguf
    from shared.engine.files import cache_dir
    from shared.engine.pull import PARTED, gguf_path

    name = name.removesuffix("+lookup")
    if name in PARTED:
        return str(gguf_path(name, cache_dir()))
    return name if gguf.is_gguf(Path(name)) else None


def llama_runs(target, methods: list[Method], prompts: list[Prompt], args: argparse.Namespace) -> dict:
    """llama.cpp on the same GGUFs and prompts: ``llama-bench``'s plain decoding, and ``llama-speculative`` with
    each model drafter that is a GGUF (greedy, ``--tree-depth`` tokens a round), as runs named
    ``llama.cpp <drafter>`` (never compared for identity: another engine's numerics)."""
    from bench.llama import speculative

    model = gguf_of(args.model)
    if model is None:
        return {"error": f"{args.model} is not a GGUF: llama.cpp has nothing to run"}
    out: dict = {"target": model, "runs": []}
    if args.llama_bench:
        out.update(plain_side_by_side(target, args.llama_bench, model, args))
    drafts = {m.name: gguf_of(m.name) for m in methods if m.sampling.greedy and is_model(m.name)}
    drafts = {n: g for n, g in drafts.items() if g is not None and not n.endswith("+lookup")}
    if not args.llama_speculative or not drafts:
        return out
    bar = tqdm(total=len(prompts) * len(drafts), desc="llama-speculative", unit="run", file=sys.stderr)
    for prompt in prompts:
        text = target.tokenizer.decode(prompt.ids)  # the chat template, special tokens written out (it parses them)
        for name, draft in drafts.items():
            s = speculative(args.llama_speculative, model, draft, text, args.max_new_tokens, args.threads,
                            draft_max=args.tree_depth)  # fmt: skip
            wall = s.prefill_s + s.seconds
            out["runs"].append(Run(prompt.dataset, prompt.index, f"{LLAMA} {name}", s.tokens, round(wall, 4),
                                   round(s.tokens / wall, 3), round(s.acceptance_length, 4),
                                   round(s.drafted / s.draft_max), 0.0, "length",
                                   decode_tokens_per_s=round(s.tokens_per_s, 3)))  # fmt: skip
            bar.update()
    bar.close()
    out["draft_max"] = args.tree_depth
    return out


def plain_side_by_side(target, binary: str, model: str, args: argparse.Namespace) -> dict:
    """llama.cpp's plain decoding against ours at the same moments: ``--llama-rounds`` times, the memory's read rate
    (``kernels.read_peak``), ``llama-bench`` tg (``max_new_tokens``, no prompt, one repeat), then our plain greedy
    decoding of as many tokens after a one-token prompt (no stop: the same count), the pace after its first token.
    Each pair's ratio, then their median: on a shared machine whose speed drifts by minutes, only ratios measured
    side by side mean something. Both read the same weights a token (the GGUF's, ``stream_bytes``), so each pace
    times those bytes over the read rate is the share of the memory's ceiling it reaches."""
    from bench.llama import plain_tokens_per_s
    from shared.engine import kernels

    bos = target.tokenizer.bos_token_id
    prompt = [bos if bos is not None else target.tokenizer.encode("\n", add_special_tokens=False)[0]]
    theirs, ours, read = [], [], []
    for _ in tqdm(range(args.llama_rounds), desc="plain beside llama-bench", unit="round", file=sys.stderr):
        read.append(kernels.read_peak() / 1e9 if kernels.available() else None)
        theirs.append(plain_tokens_per_s(binary, model, args.max_new_tokens, args.threads, repeats=1))
        s = generate(
            LocalVerifier(target), NoDrafter(), prompt, args.max_new_tokens,
            Settings(stop_ids=[]),
        ).stats
        ours.append((s.new_tokens - 1) / (s.wall_s - s.ttft_s))
    return {"plain_tokens_per_s": median(theirs), "plain_side_by_side": {
        "llama_tokens_per_s": [round(t, 3) for t in theirs], "ours_tokens_per_s": [round(t, 3) for t in ours],
        "read_gb_per_s": [None if r is None else round(r, 2) for r in read],
        "gb_per_token": round(stream_bytes(target) / 1e9, 4),
        "median_ratio": round(median([o / t for o, t in zip(ours, theirs, strict=True)]), 4)}}  # fmt: skip


def side_by_side_table(side: dict) -> list[str]:
    """The rounds of ``plain_side_by_side``: each engine's pace and the share of the memory's ceiling it reached."""
    gb, reads = side.get("gb_per_token"), side.get("read_gb_per_s") or []
    if not gb or not reads or None in reads:
        return []
    lines = [f"\n| round | memory read GB/s | its ceiling tok/s ({gb:.3f} GB a token) | llama.cpp tok/s | ours tok/s "
             "| ours ÷ llama.cpp |", "|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for i, (r, t, o) in enumerate(zip(reads, side["llama_tokens_per_s"], side["ours_tokens_per_s"], strict=True)):
        lines.append(f"| {i + 1} | {r:.1f} | {r / gb:.1f} | {t:.2f} ({t * gb / r:.0%}) | {o:.2f} ({o * gb / r:.0%}) "
                     f"| {o / t:.3f}× |")  # fmt: skip
    return lines


def llama_lines(llama: dict) -> str:
    if not llama:
        return ""
    lines, table = [], []
    if "plain_tokens_per_s" in llama:
        lines.append(f"llama.cpp plain decoding (llama-bench tg, same GGUF, same threads; no prompt: a decode pace): "
                     f"{llama['plain_tokens_per_s']:.2f} tok/s.")  # fmt: skip
    if "plain_side_by_side" in llama:
        side = llama["plain_side_by_side"]
        ours, theirs = median(side["ours_tokens_per_s"]), median(side["llama_tokens_per_s"])
        lines.append(f"Side by side ({len(side['ours_tokens_per_s'])} rounds alternating llama-bench and our plain "
                     f"decoding of as many tokens after a one-token prompt): ours {ours:.2f} tok/s against "
                     f"{theirs:.2f}, **{side['median_ratio']:.3f}× llama.cpp** (median of the rounds' ratios).")
        table = side_by_side_table(side)
    if "draft_max" in llama:
        lines.append(f"`llama.cpp <drafter>` rows: llama-speculative -md <drafter's GGUF>, greedy, "
                     f"{llama['draft_max']} draft tokens a round; its own numerics, so not compared for identity.")
    if "error" in llama:
        lines.append(f"llama.cpp not run: {llama['error']}.")
    return " ".join(lines) + "\n" + "\n".join(table) + "\n\n"


def run_method(target, method: Method, prompt_ids: list[int], max_new_tokens: int, seed: int = 0):
    verifier = LocalVerifier(target)
    policy = None
    if method.adaptive and method.name != REFERENCE:
        from client.loop.adaptive import AdaptivePolicy

        # each prompt starts from what the previous ones taught the policy, as a serving process's would
        policy = AdaptivePolicy.for_run(verifier, method.drafter.payload_specs(), previous=method.policy)
        method.policy = policy
    return generate(
        verifier, method.drafter, prompt_ids, max_new_tokens,
        Settings(
            sampling=replace(method.sampling, seed=seed),
            max_tree_nodes=64 if policy else method.max_tree_nodes,
            policy=policy,
        ),
    )  # fmt: skip


def benchmark(target, methods: list[Method], prompts: list[Prompt], max_new_tokens: int) -> list[Run]:
    """Run every method on every prompt, interleaved and rotated, and check greedy ids against ``none``'s."""
    runs: list[Run] = []
    bar = tqdm(total=len(prompts) * len(methods), desc="single", unit="run", file=sys.stderr)
    for k, prompt in enumerate(prompts):
        shift = k % len(methods)  # rotate so no method always runs first (or right after another)
        done: dict[str, tuple[Run, list[int]]] = {}
        for method in methods[shift:] + methods[:shift]:
            bar.set_postfix_str(f"{prompt.dataset} {prompt.index} {method.name}")
            gen = run_method(target, method, prompt.ids, max_new_tokens, seed=k)
            s = gen.stats
            decoding = s.wall_s - s.ttft_s
            pace = round((s.new_tokens - 1) / decoding, 3) if s.new_tokens > 1 and decoding > 0 else None
            run = Run(
                prompt.dataset, prompt.index, method.name, s.new_tokens, round(s.wall_s, 4), round(s.tokens_per_s, 3),
                round(s.acceptance_length, 4), s.rounds, round(s.draft_s, 4), gen.finish_reason,
                decode_tokens_per_s=pace,
            )  # fmt: skip
            done[method.name] = (run, gen.token_ids)
            runs.append(run)
            bar.update()
        if methods[0].sampling.greedy:  # sampled outputs differ by design: their check is the distribution's
            mark_differences(done, REFERENCE, f"{prompt.dataset} prompt {prompt.index} ({prompt.id})")
    bar.close()
    return runs


def summarize(runs: list[Run], names: list[str]) -> dict[str, dict[str, dict]]:
    """{method: {dataset: median tok/s, mean τ, median speedup over none, mismatches, ...}}."""
    summary: dict[str, dict[str, dict]] = {}
    for m in names:
        summary[m] = {}
        for d in DATASETS:
            mine = [r for r in runs if r.method == m and r.dataset == d]
            if not mine:
                continue
            reference = {r.prompt: r for r in runs if r.method == REFERENCE and r.dataset == d}
            base = {p: r.tokens_per_s for p, r in reference.items()}
            decoding = {p: r.decode_tokens_per_s for p, r in reference.items() if r.decode_tokens_per_s}
            summary[m][d] = {
                "prompts": len(mine),
                "median_tokens_per_s": median([r.tokens_per_s for r in mine]),
                "mean_acceptance_length": round(statistics.fmean(r.acceptance_length for r in mine), 3),
                "median_speedup": median([r.tokens_per_s / base[r.prompt] for r in mine if r.prompt in base]),
                "median_decode_tokens_per_s": median([r.decode_tokens_per_s for r in mine if r.decode_tokens_per_s]),
                "median_decode_speedup": median([r.decode_tokens_per_s / decoding[r.prompt] for r in mine
                                                 if r.decode_tokens_per_s and r.prompt in decoding]),  # fmt: skip
                "median_draft_share": median([r.draft_s / r.wall_s for r in mine]),
                "median_draft_ms_per_round": median([1000 * r.draft_s / r.rounds for r in mine if r.rounds]),
                "mean_new_tokens": round(statistics.fmean(r.tokens for r in mine), 1),
                "mismatches": sum(r.matches_reference is False for r in mine),
            }
    return summary


def markdown(summary: dict[str, dict[str, dict]], greedy: bool = True) -> str:
    """The table; ``≠ plain`` only for greedy runs (sampled outputs differ by design)."""
    lines = [
        "| method | dataset | τ | tok/s | speedup | decode tok/s | decode speedup | drafting share | draft ms/round "
        f"| ≠ {'plain' if REFERENCE == 'none' else REFERENCE} |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m, per in summary.items():
        ours = m != REFERENCE and not m.startswith(LLAMA)  # llama.cpp's rows: not timed inside, not compared
        for d, s in per.items():
            cells = [
                cell(s["mean_acceptance_length"], ".2f"),
                cell(s["median_tokens_per_s"], ".2f"),
                times(s["median_speedup"]),
                cell(s.get("median_decode_tokens_per_s"), ".2f"),
                times(s.get("median_decode_speedup")),
                f"{s['median_draft_share']:.0%}" if ours else "–",
                cell(s.get("median_draft_ms_per_round"), ".1f") if ours else "–",
                f"{s['mismatches']}/{s['prompts']}" if ours and greedy else "–",
            ]
            lines.append(f"| {m} | {d} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def draft_step_costs(target, methods: list[Method], prompts: list[Prompt], rounds: int) -> dict[str, dict]:
    """{method: median ms of one drafting step (a tree level: ``root_logprobs``/``expand``), steps per tree} for
    each tree drafter, over ``rounds`` static trees after the first HumanEval prompt (the last prompt without one)."""
    from bench.engine import draft_steps

    if rounds < 1:
        return {}
    prompt = next((q for q in prompts if q.dataset == "humaneval"), prompts[-1])
    out, seen = {}, set()
    for m in methods:
        if m.name == REFERENCE or id(m.drafter) in seen:
            continue
        seen.add(id(m.drafter))
        cost = draft_steps(target, m.drafter, m.max_tree_nodes, prompt.ids, rounds)
        if cost is not None:
            out[m.name] = cost
    return out


def step_lines(steps: dict[str, dict]) -> str:
    """The drafting-step table, each step also as a share of the costliest drafter's (a whole model, where run)."""
    if not steps:
        return ""
    costliest = max(v["ms_per_step"] for v in steps.values())
    lines = ["", "", "| drafter | draft step ms | × the costliest | steps per tree |", "|---|---:|---:|---:|"]
    lines += [f"| {n} | {v['ms_per_step']:.2f} | {v['ms_per_step'] / costliest:.2f} | {v['steps_per_tree']:.1f} |"
              for n, v in steps.items()]  # fmt: skip
    return "\n".join(lines)


def training_lines(methods: list[Method]) -> list[str]:
    """One line per trained drafter: its training budget as its bundle records it."""
    lines = []
    for m in methods:
        if m.bundle is None:
            continue
        t = m.bundle.get("training") or {}
        tokens = f"{t['tokens']:,} tokens" if isinstance(t.get("tokens"), int) else "? tokens"
        wall = f"{t['wall_s'] / 3600:.2f} h" if isinstance(t.get("wall_s"), int | float) else "? h"
        lines.append(f"* {m.name}: trained on {tokens} in {wall} on {t.get('hardware', '?')} ({m.bundle['path']})")
    return lines


def plot(summary: dict[str, dict[str, dict]], path: Path, title: str) -> None:
    """Grouped bars, one group per method, one bar per dataset: speedup over plain decoding, and τ."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    colors = {"mt-bench": "#1b9e77", "humaneval": "#d95f02"}
    width = 0.8 / len(DATASETS)
    for ax, key, label in (
        (axes[0], "median_speedup", "speedup over plain decoding (median over prompts)"),
        (axes[1], "mean_acceptance_length", "τ: tokens per verification round (mean over prompts)"),
    ):
        for j, d in enumerate(DATASETS):
            xs = [i + (j - (len(DATASETS) - 1) / 2) * width for i in range(len(names))]
            values = [(summary[m].get(d) or {}).get(key) or 0.0 for m in names]
            bars = ax.bar(xs, values, width, color=colors[d], label=d)
            ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xticks(range(len(names)), names, rotation=20)
        ax.set_ylabel(label, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, path, title)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default = ",".join(DEFAULT_DRAFTERS)
    p.add_argument("--drafters", default=default, help=f"comma list (default {default}); '{REFERENCE}' always runs")
    p.add_argument("--bundle-dir", type=Path, help="look for trained drafters' bundles in DIR/<name> first")
    p.add_argument("--tree-width", type=int, default=4, help="trained drafters: EAGLE-2 tree width B (default 4)")
    p.add_argument("--tree-depth", type=int, default=5, help="trained drafters: EAGLE-2 tree depth D (default 5)")
    p.add_argument("--max-tree-nodes", type=int, default=16, help="trained drafters: tree nodes per round (default 16)")
    p.add_argument("--draft-vocabs", default="",
                   help="trained drafters: one method per draft vocabulary size, comma list, e.g. 8k,16k,24k,full "
                        "(k = 1024; full = the target's whole vocabulary; default: each bundle's own)")
    p.add_argument("--drafter-weights", default="auto",
                   help="one method per setting of a trained drafter's own layers' weights or a model drafter's "
                        "path, comma list of auto, native, int8, int4 (as `splitspec generate --drafter-weights`; "
                        "default auto)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample at this temperature, seed = the prompt's index (default 0: greedy)")
    p.add_argument("--acceptance", default="exact",
                   help=f"comma list of rules sampled drafts are judged by ({', '.join(ACCEPTANCE)}): one method "
                        "per rule; typical is not lossless (default exact)")  # fmt: skip
    p.add_argument("--adaptive", action="store_true",
                   help="run drafters under the adaptive policy (trees sized by measured costs, drafting paused while "
                        "it loses), as `splitspec generate --local` does by default, each prompt's policy starting "
                        "from the previous one's (as in a serving process); else static trees")
    p.add_argument("--draft-step-rounds", type=int, default=8,
                   help="static trees each tree drafter drafts after a HumanEval prompt to time its steps (default 8; "
                        "0: no step table)")
    p.add_argument("--limit", type=int, help="first K prompts of each dataset (default all: 80 + 164)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="token budget per generation (default 128)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"the target (default {DEFAULT_MODEL})")
    p.add_argument("--device", default="cpu", help="target (and drafter) device (default cpu)")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="target dtype (default auto: measured)")
    p.add_argument("--cuda-graphs", action="store_true", help="the target's forwards on CUDA graphs, as `serve "
                   "--cuda-graphs` serves them (a model drafter on CUDA always drafts on them)")  # fmt: skip
    p.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH"),
                   help="llama-bench binary: llama.cpp's plain decoding on the target's GGUF (default $LLAMA_BENCH)")
    p.add_argument("--llama-rounds", type=int, default=5,
                   help="rounds of llama-bench alternating with our plain decoding (their ratios' median is reported)")
    p.add_argument("--llama-speculative", default=os.environ.get("LLAMA_SPECULATIVE"),
                   help="llama-speculative binary: llama.cpp's speculative decoding with each GGUF model drafter "
                   "(default $LLAMA_SPECULATIVE)")  # fmt: skip
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results", help="output folder")
    args = p.parse_args(argv)
    names = [ALIASES.get(m.strip(), m.strip()) for m in args.drafters.split(",") if m.strip()]
    if REFERENCE not in names:
        names.insert(0, REFERENCE)
    args.drafters = list(dict.fromkeys(names))
    args.acceptance = [r.strip() for r in args.acceptance.split(",") if r.strip()]
    if not args.acceptance or set(args.acceptance) - set(ACCEPTANCE):
        p.error(f"--acceptance takes a comma list of {', '.join(ACCEPTANCE)}, got {','.join(args.acceptance)!r}")
    args.drafter_weights = [w.strip() for w in args.drafter_weights.split(",") if w.strip()]
    if not args.drafter_weights or set(args.drafter_weights) - {"auto", "native", "int8", "int4"}:
        p.error(f"--drafter-weights takes a comma list of auto, native, int8, int4, got {args.drafter_weights!r}")
    if not args.temperature >= 0:
        p.error(f"--temperature must be >= 0, got {args.temperature}")
    try:
        args.draft_vocabs = [parse_size(v) for v in args.draft_vocabs.split(",") if v.strip()]
    except ValueError:
        p.error(f"--draft-vocabs takes sizes like 8192, 8k or full, got {args.draft_vocabs!r}")
    for name in ("limit", "max_new_tokens", "threads", "tree_width", "tree_depth", "max_tree_nodes"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def sampled(args: argparse.Namespace) -> str:
    """How the run decodes, for its header: greedy, or the temperature and the rules (sampled outputs are not
    compared with plain decoding's: ≠ plain is 0 by construction)."""
    if args.temperature == 0:
        return "greedy"
    return f"sampled at T={args.temperature:g} (seed = prompt index; rules: {', '.join(args.acceptance)})"


def parse_size(text: str) -> int:
    """``8192``, ``8k`` (x1024) or ``full`` (0: the whole vocabulary)."""
    text = text.strip().lower()
    if text == "full":
        return 0
    size = int(text[:-1]) * 1024 if text.endswith("k") else int(text)
    if size < 1:
        raise ValueError(text)
    return size


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start(args.threads)
    target = load_target(args.model, device=args.device, dtype=args.dtype, graphs=args.cuda_graphs)
    prompts = load_prompts(target.tokenizer, args.limit)
    methods, skipped = make_methods(args.drafters, target, args)
    for m in methods:
        m.adaptive = args.adaptive
    names = [m.name for m in methods]
    coverage = dict(m.vocabulary for m in methods if m.vocabulary and m.vocabulary[0] != "full")

    warm_ids = encode_prompt(target.tokenizer, WARMUP_PROMPT, chat=True)
    for method in tqdm(methods, desc="warm-up", unit="method", file=sys.stderr):
        run_method(target, method, warm_ids, 8)  # first calls pay one-off costs (allocator, kernels, caches)
    runs = benchmark(target, methods, prompts, args.max_new_tokens)
    steps = draft_step_costs(target, methods, prompts, args.draft_step_rounds)
    llama = llama_runs(target, methods, prompts, args) if args.llama_speculative or args.llama_bench else {}
    runs += llama.pop("runs", [])
    names += list(dict.fromkeys(r.method for r in runs if r.method not in names))

    env = {**environment(args.threads, args.device), "device": args.device,
           "dtype": str(target.dtype).removeprefix("torch.")}  # fmt: skip
    summary = summarize(runs, names)
    table = markdown(summary, greedy=args.temperature == 0)
    counts = {d: sum(p.dataset == d for p in prompts) for d in DATASETS}
    settings = {
        "model": args.model,
        "max_new_tokens": args.max_new_tokens,
        "greedy": args.temperature == 0,
        "temperature": args.temperature,
        "acceptance": args.acceptance,
        "methods": names,
        "skipped": skipped,
        "reference": REFERENCE,
        "tree": {"width": args.tree_width, "depth": args.tree_depth, "max_tree_nodes": args.max_tree_nodes},
        "adaptive": args.adaptive,
        "drafter_weights": args.drafter_weights,
        "untrained_max_tree_nodes": UNTRAINED_MAX_TREE_NODES,
        "humaneval_template": HUMANEVAL_TEMPLATE,
        "prompts": counts,
        "bundles": {m.name: m.bundle for m in methods if m.bundle is not None},
        "draft_vocab_coverage": coverage,
    }
    mismatches = sum(s["mismatches"] for per in summary.values() for s in per.values())
    result = {"environment": env, "settings": settings, "summary": summary, "mismatches": mismatches,
              "llama_cpp": llama, "draft_steps": steps}  # fmt: skip
    result["prompts"] = [
        {"dataset": p.dataset, "index": p.index, "id": p.id, "prompt_tokens": len(p.ids), "text": p.text}
        for p in prompts
    ]
    result["runs"] = [asdict(r) for r in runs]
    trained = training_lines(methods)
    header = (
        f"# Single-device drafter benchmark\n\n`{env['command']}`\n\n{env['date']}, torch {env['torch']}, "
        f"transformers {env['transformers']}, {args.model} ({env['dtype']}, {args.device}), {env['threads']} threads "
        f"of {env['cpu_count']} CPUs ({env['cpu']}); {counts['mt-bench']} MT-Bench first turns + "
        f"{counts['humaneval']} HumanEval problems, {sampled(args)}, ≤{args.max_new_tokens} new tokens, stop at EOS; "
        f"trained drafters: EAGLE-2 trees B={args.tree_width}, D={args.tree_depth}, ≤{args.max_tree_nodes} nodes.\n"
        f"τ = tokens per verification round, mean over prompts; tok/s = median over prompts; speedup = median over "
        f"prompts of tok/s ÷ plain decoding's tok/s on that prompt; decode: the same after the first token (the "
        f"prompt's prefill apart, as llama.cpp counts); ≠ plain counts prompts whose token ids differ "
        f"from plain decoding's.\n\n"
        + ("Training budgets (from each bundle's config.json):\n\n" + "\n".join(trained) + "\n\n" if trained else "")
        + ("Draft vocabularies (`--draft-vocabs`; share of sampled assistant tokens covered): "
           + ", ".join(f"{k} {v:.2%}" for k, v in coverage.items()) + ", full 100%.\n\n"
           if coverage else "")
        + skipped_note(skipped)
        + llama_lines(llama)
    )
    title = (f"{args.model}, single device ({args.device}, {args.threads} threads), {sampled(args)}, "
             f"≤{args.max_new_tokens} new tokens, {counts['mt-bench']} + {counts['humaneval']} prompts")  # fmt: skip
    plot(summary, args.out / "single.png", title)
    notes = [f"skipped (no bundle for this target): {', '.join(skipped)}"] if skipped else []
    notes += [f"WARNING: {mismatches} run(s) produced token ids different from {REFERENCE}"] if mismatches else []
    table += step_lines(steps)
    return finish(args.out, "single", result, header + table, table, notes)


if __name__ == "__main__":
    sys.exit(main())
