"""What a MoA drafter's predictions rest on: its memory of the target (CA), draft step by draft step.

MoA drafts from three sources: its own SA over the tokens, CA over the target's memory of tokens verified
before the draft began, and (TLI > 0) the target's last layers. If it learnt to lean on SA alone it is an
independent LM with extra steps, which would explain MoA ≈ EAGLE and TLI=3 ≈ TLI=0
(bench/results/moa-probe/reference.md, ablation 1: the reference's staircase curriculum exists to force the use of
CA). This measures it, with no training, on the bundles at hand.

Data: the target's own greedy answers (≤ ``--max-new-tokens``) to the first ``--limit`` MT-Bench first turns
and HumanEval problems, worded as ``bench.single`` words them; none are training data. One target forward
per answer gives every layer's KV and hidden state (``client.training.teacher``).

Each answer is cut into drafts of ``--horizon`` K tokens; the position that predicts the j-th token of a
draft is at *step* j: its CA sees memory of tokens before the draft's root only, its TLI layers the
target's KV before the root and their own from it on — exactly as a drafter that has not heard from the
server for j-1 tokens (j ≤ 4: the trees it drafts; larger j: generating on its own after a disconnection).
All K phases of the cuts are run, and the answer's tokens from the K-th on are scored, so every scored token is
scored once at every step: the steps differ in what the drafter knows, not in which tokens. Per MoA bundle two
conditions: ``memory`` (as it drafts) and ``no memory`` (CA sees only its learnt null slot; TLI unchanged).
Scored: top-1 agreement of the drafter's token with the target's greedy token, per step. EAGLE is scored the
same way, fed the target's features before the root and its own predicted ones from the root on (as in a tree and
offline); Medusa by head j from the state before the root (nothing past its last head); the independent drafter
(no memory at all, the same at every step) is the reference.

Also recorded: the RMS of the states MoA predicts (entering the target's last N layers, and the normed final
state) — whether an unscaled SmoothL1 (β = 1) on them would sit in its quadratic or its linear regime.

Run:  .venv/bin/python -m bench.probe [--limit K] [--max-new-tokens N] [--horizon K] [--drafters a,b]
Writes probe.json, probe.md and probe.png under --out (default bench/results).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from bench.common import environment, finish, save_figure, start
from bench.single import bundle_path, load_prompts
from client.drafters import NoDrafter
from client.drafters.bundle import load_bundle
from client.loop.decode import generate
from client.training.teacher import TargetBatch, pad_batch, run_teacher
from client.verifiers import LocalVerifier
from shared.engine.decoder import DTYPES
from shared.engine.models import DEFAULT_MODEL, load_target
from shared.errors import SplitspecError
from shared.tree import causal_mask

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DRAFTERS = "moa-tli0,moa-tli1,moa-tli3,independent,eagle,medusa"
BANDS = ((1, 1), (1, 4), (5, 8), (9, 16))  # step ranges in the table: the root's own guess, tree depths, offline


def draft_starts(length: int, root: int, horizon: int, device: torch.device | str | None = None) -> torch.Tensor:
    """[K, T]: for each phase of the cuts, the root of the draft each position belongs to.

    ``root`` is the last prompt position (it predicts the answer's first token); drafts are ``horizon`` long,
    the first one shortened by the phase. Positions before ``root`` are their own roots (never scored).
    """
    t = torch.arange(length, device=device)
    starts = []
    for phase in range(horizon):
        first = root + phase  # end of the first, shortened draft
        later = first + torch.div(t - first, horizon, rounding_mode="floor") * horizon
        starts.append(torch.where(t < root, t, torch.where(t < first, torch.full_like(t, root), later)))
    return torch.stack(starts)


def token_ids(model, logits: torch.Tensor) -> torch.Tensor:
    """The drafter's top-1 as the target's token ids (a draft vocabulary indexes its own rows)."""
    best = logits.argmax(-1)
    vocab = model.parts.vocab_ids
    return best if vocab is None else vocab[best]


@torch.inference_mode()
def moa_logits(model, tb: TargetBatch, starts: torch.Tensor, memory: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's logits [K, M, V] and the step [K, M] of every scored position, over all phases;
    ``memory=False`` blanks CA's memory."""
    K = starts.shape[0]
    L, N = model.cfg.num_layers, model.cfg.tli
    ids, kv = tb.input_ids.expand(K, -1), tb.kv.expand(K, -1, -1, -1)
    ca_starts = starts if memory else torch.zeros_like(starts)
    hidden = model.forward_train(ids, kv, ca_starts)
    layers = zip(tb.keys[L - N :], tb.values[L - N :], strict=True)
    tli_kv = [(k.expand(K, -1, -1, -1), v.expand(K, -1, -1, -1)) for k, v in layers] if N else None
    out = model.head_train(hidden, starts, tli_kv)
    cols = tb.cols
    steps = cols[None, :] - starts[:, cols] + 1
    return model.parts.logits(out[:, cols]), steps


@torch.inference_mode()
def independent_hits(model, tb: TargetBatch) -> torch.Tensor:
    T = tb.input_ids.shape[1]
    positions = torch.arange(T, device=tb.input_ids.device)[None]
    hidden = model(tb.input_ids, positions, causal_mask(T, tb.input_ids.device))
    return token_ids(model, model.parts.logits(hidden[0, tb.cols])) == tb.input_ids[0, tb.cols + 1]


@torch.inference_mode()
def eagle_logits(model, tb: TargetBatch, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE's logits [K, M, V] and steps [K, M], drafting as it does: every position before a draft's root fed
    the target's features, the draft's own positions fed EAGLE's own predicted ones (in a tree and offline).

    One pass of its block runs two streams — on the target's features and on the drafts' features — and each
    query attends to the first before its draft's root and to the second from the root on. Pass i gets steps
    <= i right; K passes, all of them."""
    K, T = starts.shape
    dtype = model.block.input_layernorm.weight.dtype
    true = tb.hidden[-1].to(dtype)  # [1, T, E]: f_p
    p = torch.arange(1, T, device=starts.device)  # EAGLE's slot q is position p = q + 1, fed f_{p-1} and x_p
    roots = starts[:, 1:]  # [K, T-1]: the root of the draft each position belongs to
    given = (p - 1)[None, :] < roots  # its input f_{p-1} is the target's
    sees_true = p[None, None, :] < roots[:, :, None]  # [K, T-1, T-1]: key j (a position) before the root
    sees_own = (p[None, None, :] >= roots[:, :, None]) & (p[None, None, :] <= p[None, :, None])
    mask = torch.cat([sees_true, sees_own], dim=2)
    block, embedded = model.block, model.parts.embed(tb.input_ids[:, 1:]).to(dtype)
    rope = model.parts.rope(p[None], dtype)
    x_true = model.fc(torch.cat([true[:, :-1], embedded], dim=-1))
    _, k_true, v_true = block.self_attn.project(block.input_layernorm(x_true), rope)
    k_true, v_true = k_true.expand(K, -1, -1, -1), v_true.expand(K, -1, -1, -1)
    features = true[:, :-1].expand(K, -1, -1)
    for _ in range(K):
        x = model.fc(torch.cat([features, embedded.expand(K, -1, -1)], dim=-1))
        q, k, v = block.self_attn.project(block.input_layernorm(x), rope)
        x = x + block.self_attn.attend(q, torch.cat([k_true, k], dim=2), torch.cat([v_true, v], dim=2), mask)
        predicted = x + block.mlp(block.post_attention_layernorm(x))  # [K, T-1, E]: f̂_p at slot p - 1
        own = torch.cat([true[:, :1].expand(K, -1, -1), predicted[:, :-1]], dim=1)  # slot q gets f̂_q
        features = torch.where(given[..., None], true[:, :-1], own)
    cols = tb.cols
    return model.parts.logits(predicted[:, cols - 1]), cols[None, :] - starts[:, cols] + 1


@torch.inference_mode()
def medusa_logits(model, tb: TargetBatch, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Medusa's logits [K, M, V] and steps [K, M]: the j-th token of a draft is head j's guess from the target's
    state f_{root-1}, the newest it has; past its last head it has none (zero logits: never right)."""
    cols = tb.cols
    steps = cols[None, :] - starts[:, cols] + 1
    heads = model(tb.hidden[-1][0])  # [H, T, V]: every head at every position
    head = (steps.clamp(max=len(heads)) - 1).clamp_min(0)
    logits = heads[head, (starts[:, cols] - 1).clamp_min(0)]
    return torch.where((steps <= len(heads))[..., None], logits, torch.zeros_like(logits)), steps


def conditions(model, tb: TargetBatch, starts: torch.Tensor):
    """(condition, logits, steps) for each way a drafter is scored: EAGLE as it drafts, Medusa's heads, MoA with
    and without its memory of the target."""
    if model.kind == "eagle":
        yield "own features", *eagle_logits(model, tb, starts)
        return
    if model.kind == "medusa":
        yield "heads", *medusa_logits(model, tb, starts)
        return
    for condition in ("memory", "no memory"):
        yield condition, *moa_logits(model, tb, starts, condition == "memory")


def state_scale(tb: TargetBatch, layers: int) -> dict[str, float]:
    """Mean per-token RMS of the states a MoA predicts, over the answer's positions."""
    scale = {}
    for n in (0, 1, 3):
        state = tb.hidden[layers - n][0, tb.cols].float()
        scale[f"tli{n}"] = round(float(state.pow(2).mean(-1).sqrt().mean()), 4)
    return scale


def rate(hits: list[torch.Tensor]) -> float | None:
    total = sum(int(h.numel()) for h in hits)
    return round(sum(int(h.sum()) for h in hits) / total, 4) if total else None


def probe(target, drafters: dict[str, object], prompts, max_new_tokens: int, horizon: int) -> dict:
    """Per drafter and condition: agreement per step 1..horizon and the number of scored positions."""
    per_step: dict[tuple[str, str], dict[int, list[torch.Tensor]]] = {}
    flat: dict[str, list[torch.Tensor]] = {}
    scales, scored = [], 0
    for prompt in tqdm(prompts, desc="probe", unit="prompt", file=sys.stderr):
        answer = generate(LocalVerifier(target), NoDrafter(), prompt.ids, max_new_tokens).token_ids
        if not answer:
            continue
        ids = prompt.ids + answer
        input_ids, valid, mask = pad_batch([(ids, [0] * len(prompt.ids) + [1] * len(answer))])
        tb = run_teacher(target, input_ids, valid, mask)
        keep = tb.cols >= len(prompt.ids) - 2 + horizon  # at least K-1 tokens into the answer: scored at every step
        if not keep.any():
            continue
        tb.rows, tb.cols, tb.teacher_logits = tb.rows[keep], tb.cols[keep], tb.teacher_logits[keep]
        scales.append(state_scale(tb, target.num_layers))
        scored += int(tb.cols.numel())
        starts = draft_starts(len(ids), len(prompt.ids) - 1, horizon, tb.input_ids.device)
        for name, model in drafters.items():
            if model.kind == "independent":
                flat.setdefault(name, []).append(independent_hits(model, tb))
                continue
            for condition, logits, steps in conditions(model, tb, starts):
                hits = token_ids(model, logits) == tb.input_ids[0, tb.cols + 1][None, :]
                bucket = per_step.setdefault((name, condition), {})
                for s in range(1, horizon + 1):
                    bucket.setdefault(s, []).append(hits[steps == s])
    rows = []
    for (name, condition), bucket in per_step.items():
        by_step = {s: rate(h) for s, h in bucket.items()}
        bands = {f"{a}-{b}" if a != b else str(a): rate([x for s in range(a, b + 1) for x in bucket.get(s, [])])
                 for a, b in BANDS if a <= horizon}  # fmt: skip
        rows.append({"drafter": name, "condition": condition, "by_step": by_step, "bands": bands,
                     "positions": scored})  # fmt: skip
    for name, hits in flat.items():
        condition = "no memory (its kind)"
        rows.append({"drafter": name, "condition": condition, "all": rate(hits),
                     "positions": sum(int(h.numel()) for h in hits)})  # fmt: skip
    scale = {k: round(sum(s[k] for s in scales) / len(scales), 4) for k in scales[0]} if scales else {}
    return {"rows": rows, "state_rms": scale}


def markdown(result: dict, horizon: int) -> str:
    bands = [f"{a}-{b}" if a != b else str(a) for a, b in BANDS if a <= horizon]
    lines = ["| drafter | condition | " + " | ".join(f"step {b}" for b in bands) + " | positions |",
             "|---|---|" + "---:|" * (len(bands) + 1)]  # fmt: skip
    for row in result["rows"]:
        if "bands" in row:
            cells = [f"{row['bands'][b]:.3f}" if row["bands"][b] is not None else "–" for b in bands]
        else:
            cells = [f"{row['all']:.3f}" if row["all"] is not None else "–"] * len(bands)
        lines.append(f"| {row['drafter']} | {row['condition']} | " + " | ".join(cells) + f" | {row['positions']} |")
    rms = result["state_rms"]
    if rms:
        lines.append("")
        lines.append(
            "RMS of the state a MoA predicts (mean over answer positions): "
            + ", ".join(f"TLI={k.removeprefix('tli')}: {v:.3f}" for k, v in rms.items())
            + " (TLI=0: the normed final state). SmoothL1 with β = 1 is quadratic below |error| 1."
        )
    return "\n".join(lines)


def plot(result: dict, horizon: int, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.6))
    steps = list(range(1, horizon + 1))
    for i, row in enumerate(r for r in result["rows"] if "by_step" in r):
        color = f"C{i // 2}"
        style = "-" if row["condition"] == "memory" else "--"
        values = [row["by_step"].get(s) or 0.0 for s in steps]
        ax.plot(steps, values, style, color=color, marker="o", ms=3, label=f"{row['drafter']} ({row['condition']})")
    for j, row in enumerate(r for r in result["rows"] if "all" in r):
        ax.axhline(row["all"] or 0.0, color=f"C{6 + j}", lw=0.9, ls=":", label=f"{row['drafter']} ({row['condition']})")
    ax.set_xlabel("draft step (tokens since the last verified one)")
    ax.set_ylabel("top-1 agreement with the target")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save_figure(fig, path, title)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafters", default=DEFAULT_DRAFTERS, help=f"comma list of bundles (default {DEFAULT_DRAFTERS})")
    p.add_argument("--bundle-dir", type=Path, help="look for bundles in DIR/<name> first")
    p.add_argument("--limit", type=int, default=5, help="first K prompts of each dataset (default 5)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="length of the target's answers (default 128)")
    p.add_argument("--horizon", type=int, default=16, help="draft length K: steps 1..K are scored (default 16)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"the target (default {DEFAULT_MODEL})")
    p.add_argument("--device", default="cpu", help="target and drafters' device (default cpu)")
    p.add_argument("--dtype", default="fp32", choices=list(DTYPES), help="target dtype (default fp32)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results", help="output folder")
    args = p.parse_args(argv)
    for name in ("limit", "max_new_tokens", "horizon", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    args.drafters = [d.strip() for d in args.drafters.split(",") if d.strip()]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start(args.threads)
    target = load_target(args.model, device=args.device, dtype=args.dtype)
    drafters, skipped = {}, {}
    for name in args.drafters:
        path = bundle_path(name, args.bundle_dir, target)  # the one trained for this target, where several are
        if path is None:
            skipped[name] = "no bundle"
            print(f"WARNING: skipping {name}: no bundle", file=sys.stderr)
            continue
        try:
            drafters[name] = load_bundle(path, target)[0]
        except SplitspecError as exc:  # made for another target (the 1.5B's on the 0.5B: the same tokenizer)
            skipped[name] = str(exc)
            print(f"WARNING: skipping {name}: {exc}", file=sys.stderr)
    prompts = load_prompts(target.tokenizer, args.limit)
    result = probe(target, drafters, prompts, args.max_new_tokens, args.horizon)
    env = {**environment(args.threads), "device": args.device, "dtype": args.dtype}
    settings = {"model": args.model, "limit": args.limit, "horizon": args.horizon,
                "max_new_tokens": args.max_new_tokens, "drafters": list(drafters), "skipped": skipped}  # fmt: skip
    result = {"environment": env, "settings": settings, **result}
    table = markdown(result, args.horizon)
    header = (f"# What MoA's drafts rest on\n\n`{env['command']}`\n\n{env['date']}, {args.model} ({args.dtype}), "
              f"{env['threads']} threads of {env['cpu_count']} CPUs ({env['cpu']}); the target's greedy answers "
              f"(≤{args.max_new_tokens} tokens) to {args.limit} MT-Bench + {args.limit} HumanEval prompts; drafts "
              f"of {args.horizon}, all phases. Top-1 agreement with the target's token by draft step.\n\n")  # fmt: skip
    plot(result, args.horizon, args.out / "probe.png", f"{args.model}: MoA with and without its memory of the target")
    return finish(args.out, "probe", result, header + table, table)


if __name__ == "__main__":
    raise SystemExit(main())
