"""The served engine on a device: ms per forward of n rows, eager and on CUDA graphs, beside the physical limit.

Per setting (inexact: torch's kernels as they come, a bf16 cache; exact: ``exact_rows``' fixed 64-row blocks, fp64
norms and attention; each eager and on graphs, ``shared.engine.graphs``), one forward of n new rows after a
--prefix-token cache (a chain: a verified tree's rows), median ms of --repeats, and plain decoding's tokens a second
over --decode-tokens. Beside them the physical limit: the bytes of the weights a forward streams over the memory
bandwidth measured here (a large copy). Each graphs setting's states are compared bit for bit with its eager
setting's, and every decode's tokens with exact eager's. On a CPU it rehearses the GPU's program (graphs run
uncaptured; the CPU's own exact path is ``bench.engine``'s).

Run:  .venv/bin/python -m bench.forward --model qwen2.5-coder-1.5b --device cuda
Writes forward.json, forward.md and forward.png under --out (default bench/results/forward).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from bench.common import environment, finish, save_figure, start, table, times
from bench.engine import prefix_tokens
from shared.engine.decoder import Part, exact_rows
from shared.engine.graphs import BUCKETS, Graphs
from shared.engine.linear import CUDA_ROWS
from shared.engine.models import DEFAULT_MODEL, load_target
from shared.tree import causal_from

MAX_ROWS = 8192  # a GPU server's --max-batch-tokens in the sitting

REPO = Path(__file__).resolve().parents[1]
SETTINGS = ("inexact", "inexact, graphs", "exact", "exact, graphs")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int) -> float:
    """Median ms of ``fn`` (the device synchronised around each call)."""
    samples = []
    for i in range(warmup + repeats):
        sync(device)
        begin = time.perf_counter()
        fn()
        sync(device)
        if i >= warmup:
            samples.append(1000 * (time.perf_counter() - begin))
    return statistics.median(samples)


def bandwidth_gbs(device: torch.device, mib: int) -> float:
    """The memory's bandwidth as one large copy sees it: bytes read plus bytes written a second (median of 5)."""
    src = torch.ones(mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timed_ms(lambda: dst.copy_(src), device, repeats=5, warmup=2)
    return 2 * src.numel() / (ms / 1000) / 1e9


def streamed_bytes(engine) -> int:
    """The bytes a forward reads of the weights: every layer's, the final norm's and the LM head's (the embedding
    only gathers rows)."""
    params = [*engine.layers.parameters(), *engine.norm.parameters(), engine.lm_head.weight]
    return sum(p.numel() * p.element_size() for p in params)


def apply(engine, setting: str, graphs: dict[str, Graphs], sizes: tuple[int, ...] = ()) -> None:
    """Put ``engine`` in ``setting`` (its graphs made once and kept: a capture holds its kernels), with a bucket for
    each of ``sizes`` past the served ones (``BUCKETS``): what a larger bucket would cost, before it is served."""
    exact = setting.startswith("exact")
    exact_rows(engine, CUDA_ROWS if exact else 0)
    engine.exact = exact
    engine.graphs = None
    if setting.endswith("graphs"):
        if setting not in graphs:
            graphs[setting] = Graphs(engine, tuple(sorted({*BUCKETS, *sizes})))
        engine.graphs = graphs[setting]


def decode(target, prompt: list[int], tokens: int) -> tuple[list[int], float]:
    """Plain greedy decoding of ``tokens`` after ``prompt``: the tokens and tokens a second (prefill not counted)."""
    session = target.session()
    with torch.inference_mode():
        session.prefill(prompt)
        sync(target.device)
        begin = time.perf_counter()
        for _ in range(tokens):
            step = session.decode_step()
            session.pick(target.engine.logits(session.run(step)[-1:]))
        sync(target.device)
    return session.tokens[len(prompt) :], tokens / (time.perf_counter() - begin)


def measure(target, args: argparse.Namespace, bar: tqdm) -> dict:
    prefix = prefix_tokens(target.tokenizer, args.prefix + max(args.sizes))
    graphs: dict[str, Graphs] = {}
    rows, states, decoded = {}, {}, {}
    for setting in SETTINGS:
        try:
            rows[setting], states[setting], decoded[setting] = run_setting(target, setting, graphs, prefix, args, bar)
        except RuntimeError as exc:  # a capture or a kernel that fails on this device: the table says so and goes on
            if not setting.endswith("graphs"):
                raise
            rows[setting] = {"error": f"{exc.__class__.__name__}: {str(exc).splitlines()[0]}"}
            bar.update(len(args.sizes) + 1)
    for setting, row in rows.items():
        if "error" in row:
            continue
        eager = setting.removesuffix(", graphs")
        row["states_equal_eager"] = None if eager == setting else all(
            torch.equal(states[setting][n], states[eager][n]) for n in args.sizes)  # fmt: skip
        row["tokens_equal_exact"] = decoded[setting] == decoded["exact"]
    apply(target.engine, "exact", graphs)  # as served
    return rows


def run_setting(target, setting: str, graphs: dict[str, Graphs], prefix: list[int], args: argparse.Namespace,
                bar: tqdm) -> tuple[dict, dict, list[int]]:  # fmt: skip
    """One setting's row: ms a forward per size, its states and its decoded tokens."""
    engine, dev = target.engine, target.device
    apply(engine, setting, graphs, tuple(args.sizes))
    cache = engine.new_cache(args.prefix + max(args.sizes))
    with torch.inference_mode():
        for a in range(0, args.prefix, 256):  # the prefix, in forwards of at most 256 rows
            b = min(a + 256, args.prefix)
            engine.forward_many([Part(prefix[a:b], list(range(a, b)), causal_from(a, b - a, dev), cache, a)])
    ms, got = {}, {}
    for n in args.sizes:
        ids = prefix[args.prefix : args.prefix + n]
        part = Part(ids, list(range(args.prefix, args.prefix + n)), causal_from(args.prefix, n, dev), cache,
                    args.prefix)  # fmt: skip

        def forward(part=part) -> torch.Tensor:
            with torch.inference_mode():
                return engine.forward_many([part])[0]

        ms[n] = timed_ms(forward, dev, args.repeats, args.warmup)
        got[n] = forward().cpu()
        bar.update(1)
    tokens, rate = decode(target, prefix[: args.prefix], args.decode_tokens)
    bar.update(1)
    row = {"ms": ms, "decode_tokens_per_s": rate,
           "buckets_captured": sorted(graphs[setting].captured) if setting in graphs else []}  # fmt: skip
    return row, got, tokens


def markdown(result: dict) -> str:
    env, sizes, limit = result["environment"], result["sizes"], result["limit"]
    where = env.get("gpu") or env["cpu"]
    lines = ["# The served engine: one forward of n rows, eager and on CUDA graphs\n", f"`{env['command']}`\n",
             f"{env['date']}, torch {env['torch']}, {result['model']} in {result['dtype']} on {result['device']} "
             f"({where}); host {env['cpu']}, load {env['load_avg_1m']:.2f} at the start.\n",
             f"Physical limit: {limit['weight_bytes'] / 1e9:.2f} GB of weights a forward ÷ "
             f"{limit['bandwidth_gbs']:.0f} GB/s (a {limit['copy_mib']} MiB copy here) = **{limit['ms']:.3f} ms** a "
             f"forward, {1000 / limit['ms']:.0f} tok/s single-stream.\n",
             f"ms a forward after a {result['prefix']}-token cache (median of {result['repeats']}; × = ratio to n=1 "
             f"of the same setting); decode: plain greedy tokens a second over {result['decode_tokens']}; ≡ eager: "
             "the graphs' states bit-equal to the eager setting's at every n; ≡ exact: the decoded tokens equal "
             "exact eager's.\n"]  # fmt: skip
    cols = ["setting", *(f"n={n}" for n in sizes), "decode tok/s", "× limit", "≡ eager", "≡ exact"]
    body = []
    for setting, row in result["rows"].items():
        if "error" in row:
            body.append([setting, *(["–"] * (len(cols) - 2)), f"failed: {row['error']}"])
            continue
        one = row["ms"][sizes[0]]
        cells = [f"{row['ms'][n]:.3f} ({times(row['ms'][n] / one)})" for n in sizes]
        same = row["states_equal_eager"]
        body.append([setting, *cells, f"{row['decode_tokens_per_s']:.1f}", times(one / limit["ms"]),
                     "–" if same is None else ("yes" if same else "**no**"),
                     "yes" if row["tokens_equal_exact"] else "no"])  # fmt: skip
    lines.append(table(cols, body))
    exact, inexact = result["rows"]["exact"]["ms"], result["rows"]["inexact"]["ms"]
    lines.append("\nExact ÷ inexact per forward: " + ", ".join(f"n={n} {times(exact[n] / inexact[n])}" for n in sizes)
                 + ". × limit: the setting's n=1 forward ÷ the physical limit (1.00× is the bound).")  # fmt: skip
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    sizes = result["sizes"]
    for setting, row in result["rows"].items():
        if "error" not in row:
            ax.plot(sizes, [row["ms"][n] for n in sizes], marker="o", label=setting)
    ax.axhline(result["limit"]["ms"], color="gray", linestyle="--", label="weights ÷ bandwidth")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows a forward")
    ax.set_ylabel("ms a forward")
    ax.legend(fontsize=8)
    where = result["environment"].get("gpu") or result["environment"]["cpu"]
    save_figure(fig, path, f"{result['model']} {result['dtype']} on {where}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"the target (default {DEFAULT_MODEL})")
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu (a rehearsal)")
    p.add_argument("--dtype", default="bfloat16", help="activations and weights (default bfloat16)")
    p.add_argument("--sizes", default="1,16,64,256", help="rows a forward, comma list (default 1,16,64,256; past "
                   f"{BUCKETS[-1]}, the largest served bucket, each gets a bucket of its own)")
    p.add_argument("--prefix", type=int, default=256, help="tokens cached before each forward (default 256)")
    p.add_argument("--repeats", type=int, default=20, help="timed forwards per size and setting (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed forwards first (default 3; the first captures)")
    p.add_argument("--decode-tokens", type=int, default=128, help="plain greedy tokens timed a setting (default 128)")
    p.add_argument("--copy-mib", type=int, default=None, help="the bandwidth copy's size (default 2048 on a GPU, 512)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "forward", help="output folder")
    args = p.parse_args(argv)
    args.sizes = sorted({int(s) for s in args.sizes.split(",") if s})
    if not args.sizes or args.sizes[0] < 1 or args.sizes[-1] > MAX_ROWS:
        p.error(f"--sizes {args.sizes}: expected row counts from 1 to {MAX_ROWS}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start(args.threads)
    target = load_target(args.model, device=args.device, dtype=args.dtype)
    dev = target.device
    copy_mib = args.copy_mib or (2048 if dev.type == "cuda" else 512)
    bandwidth = bandwidth_gbs(dev, copy_mib)
    weight_bytes = streamed_bytes(target.engine)
    with tqdm(total=len(SETTINGS) * (len(args.sizes) + 1), desc="forward", unit="run") as bar:
        rows = measure(target, args, bar)
    result = {
        "environment": environment(args.threads, args.device), "model": args.model, "device": args.device,
        "dtype": args.dtype, "sizes": args.sizes, "prefix": args.prefix, "repeats": args.repeats,
        "decode_tokens": args.decode_tokens, "target": target.describe(),
        "limit": {"weight_bytes": weight_bytes, "bandwidth_gbs": bandwidth, "copy_mib": copy_mib,
                  "ms": weight_bytes / (bandwidth * 1e9) * 1000},
        "rows": rows,
    }  # fmt: skip
    plot(result, args.out / "forward.png")
    notes = [f"{s}: the graphs' states differ from eager's" for s, r in rows.items()
             if s.startswith("exact") and r.get("states_equal_eager") is False]  # fmt: skip
    notes += [f"{s}: {r['error']}" for s, r in rows.items() if "error" in r]
    return finish(args.out, "forward", result, markdown(result), notes=notes)


if __name__ == "__main__":
    raise SystemExit(main())
