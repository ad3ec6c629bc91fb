"""Training throughput: how many target tokens a second `splitspec train` gets through.

Per configuration — each drafter alone (moa-tli0, moa-tli1, moa-tli3, eagle, independent) and all five
trained together, as `splitspec train` does — the trainer runs ``--warmup`` steps, then ``--steps`` timed
steps on the same pre-drawn batches of real ShareGPT conversations in the target's chat template. Reported:
target tokens per second of training step (the teacher's forward included, once per batch however many
drafters learn from it) and the median step, for each teacher in ``--teachers``: ``native`` (the float model the
drafters borrow their frozen parts from) and ``served`` (the target as `splitspec serve` serves it: on a CPU its
low-bit path). ``--draft-vocab N`` gives the drafters a head of N rows (the first N ids: the cost depends only on
the size), as `splitspec train` does with its most frequent ones. The data side apart: sequences and tokens per
second of the on-the-fly stream (tokenising each conversation) and of pre-tokenised shards (``client.training.shards``).

Run:  .venv/bin/python -m bench.train [--device cpu|cuda] [--seq-len 256] [--batch-size 2] [--steps 3]
Writes train.json, train.md and train.png under --out (default bench/results).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import environment, save_figure, save_results
from client.training.trainer import TrainConfig, Trainer
from shared.engine.models import DEFAULT_MODEL, load_target

CONFIGS = {
    "moa-tli0": [("moa", 0)],
    "moa-tli1": [("moa", 1)],
    "moa-tli3": [("moa", 3)],
    "eagle": [("eagle", 0)],
    "independent": [("independent", 0)],
    "all five": [("moa", 0), ("moa", 1), ("moa", 3), ("eagle", 0), ("independent", 0)],
}


def time_steps(target, drafters, batches, warmup: int, autocast: str, teacher=None, vocab_ids=None,
               mlp_hidden: int | None = None) -> dict:  # fmt: skip
    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(drafters, 10**9, Path(out), seq_len=max(len(s[0]) for b in batches for s in b),
                          batch_size=len(batches[0]), autocast=autocast, mlp_hidden=mlp_hidden)  # fmt: skip
        trainer = Trainer(target, cfg, vocab_ids, teacher)
        for batch in batches[:warmup]:
            trainer.step(batch)
        times, tokens = [], 0
        for batch in batches[warmup:]:
            if target.device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            trainer.step(batch)
            if target.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            tokens += sum(len(ids) for ids, _ in batch)
        params = sum(p.numel() for m in trainer.models.values() for p in m.parameters() if p.requires_grad)
    return {"tokens_per_s": round(tokens / sum(times), 1), "step_s": round(statistics.median(times), 3),
            "steps": len(times), "trainable_params": params}  # fmt: skip


def time_stream(stream, n: int) -> dict:
    start = time.perf_counter()
    tokens = sum(len(next(stream)[0]) for _ in range(n))
    seconds = time.perf_counter() - start
    return {"sequences_per_s": round(n / seconds, 1), "tokens_per_s": round(tokens / seconds, 1)}


def main(argv: list[str] | None = None) -> int:
    from client.training.datasets import TrainingStream

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--autocast", default="none", choices=["none", "bf16"])
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="timed steps per configuration (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {', '.join(CONFIGS)}")
    p.add_argument("--teachers", default="native", help="comma list of native, served (default native)")
    p.add_argument("--draft-vocab", type=int, default=0, help="rows of the drafters' head (default 0: all)")
    p.add_argument("--mlp-hidden", type=int, help="the drafters' MLP width (default: the target's)")
    p.add_argument("--data-sequences", type=int, default=200, help="sequences to time the data side on")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args(argv)
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown:
        p.error(f"unknown configs {sorted(unknown)}; expected some of {', '.join(CONFIGS)}")
    teachers = args.teachers.split(",")
    if set(teachers) - {"native", "served"}:
        p.error(f"--teachers takes native and/or served, got {args.teachers!r}")

    target = load_target(args.model, device=args.device, dtype=args.dtype, weights="native")
    served = load_target(args.model, device=args.device, dtype="auto") if "served" in teachers else None
    vocab_ids = torch.arange(args.draft_vocab) if args.draft_vocab else None
    stream = TrainingStream(target.tokenizer, args.seq_len, seed=1)
    batches = [[next(stream) for _ in range(args.batch_size)] for _ in range(args.warmup + args.steps)]
    rows = {}
    for name in args.configs.split(","):
        for teacher in teachers:  # side by side, per configuration
            row = f"{name}, {teacher} teacher" if len(teachers) > 1 else name
            rows[row] = time_steps(target, CONFIGS[name], batches, args.warmup, args.autocast,
                                   served if teacher == "served" else None, vocab_ids, args.mlp_hidden)  # fmt: skip
            print(row, rows[row], flush=True)
    data = {"stream": time_stream(TrainingStream(target.tokenizer, args.seq_len, seed=2), args.data_sequences)}
    try:
        from client.training.shards import ShardStream, write_shards

        with tempfile.TemporaryDirectory() as folder:
            write_shards(TrainingStream(target.tokenizer, args.seq_len, seed=2), Path(folder), args.data_sequences,
                         progress=False)  # fmt: skip
            data["shards"] = time_stream(ShardStream(Path(folder)), args.data_sequences)
    except ImportError:  # before pre-tokenised shards existed
        pass
    print("data", data, flush=True)
    result = {"args": vars(args) | {"out": str(args.out)}, "environment": environment(torch.get_num_threads()),
              "device": str(target.device), "configs": rows, "data": data}  # fmt: skip
    env = result["environment"]
    lines = [f"# Training throughput\n\n`{env['command']}`\n\n{env['date']}, {args.model}, {env['threads']} threads of "
             f"{env['cpu_count']} CPUs ({env['cpu']}).",
             f"Target tokens per second of a training step on {target.device} ({args.dtype}, autocast "
             f"{args.autocast}), batches of {args.batch_size} × ≤ {args.seq_len} ShareGPT tokens, {args.steps} "
             f"timed steps after {args.warmup}; draft vocabulary {args.draft_vocab or 'all'}; drafters' MLP "
             f"{args.mlp_hidden or 'as the target'}"
             + (f"; served teacher: {served.describe()}" if served is not None else "") + ".", "",
             "| drafters | target tok/s | median step s | trainable parameters |", "|---|---:|---:|---:|"]
    lines += [f"| {n} | {r['tokens_per_s']:.0f} | {r['step_s']:.2f} | {r['trainable_params'] / 1e6:.1f} M |"
              for n, r in rows.items()]  # fmt: skip
    lines += ["", "| data | sequences/s | tokens/s |", "|---|---:|---:|"]
    lines += [f"| {n} | {d['sequences_per_s']:.0f} | {d['tokens_per_s']:.0f} |" for n, d in data.items()]
    md = "\n".join(lines)
    print(md)
    args.out.mkdir(parents=True, exist_ok=True)
    save_results(args.out, "train", result, md)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh(list(rows), [r["tokens_per_s"] for r in rows.values()])
    ax.set_xlabel("target tokens / s of training")
    save_figure(fig, args.out / "train.png", f"splitspec train throughput ({target.device})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
