"""Quality of a served low-bit target against fp32: greedy agreement and perplexity (``make bench-quality``).

A target served with int8 weights and activations is a different model from the fp32 one (lossless relative
to itself, not to fp32). How different, on the same prompts and text:

* greedy   plain greedy decoding of ``--max-new-tokens`` (128) on the first ``--limit`` MT-Bench first turns and
           HumanEval prompts (chat template), fp32 and each of ``--weights``: the share of prompts whose 128 tokens
           are identical, the median first differing token, and teacher-forced top-1 agreement (the low-bit
           target fed fp32's own greedy answer: how often its argmax is fp32's next token, per position);
* ppl      perplexity on the assistant tokens of ``--conversations`` ShareGPT conversations taken from the end
           of the file (≤ ``--seq-len`` tokens each, contaminated ones skipped), each target teacher-forced.

Run:  .venv/bin/python -m bench.quality [--limit 10] [--max-new-tokens 128] [--conversations 40]
Writes quality.json and quality.md under --out (default bench/results).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from bench.common import environment, first_difference, save_results
from client.drafters import NoDrafter
from client.loop.decode import generate
from client.training.datasets import encode_chat, is_contaminated, sharegpt_conversations
from client.verifiers import LocalVerifier
from shared.engine.models import DEFAULT_MODEL, load_target
from shared.tree import causal_from

REPO = Path(__file__).resolve().parents[1]


def prompts(tokenizer, limit: int) -> list[tuple[str, list[int]]]:
    from bench.single import load_prompts

    return [(f"{p.dataset}/{p.id}", p.ids) for p in load_prompts(tokenizer, limit)]


def held_out(tokenizer, count: int, seq_len: int) -> list[tuple[list[int], list[int]]]:
    """The last ``count`` usable ShareGPT conversations in file order: (ids, assistant mask)."""
    found = []
    for messages in sharegpt_conversations():
        if is_contaminated(messages):
            continue
        ids, mask = encode_chat(tokenizer, messages, max_tokens=seq_len)
        if sum(mask) >= 16:
            found.append((ids, mask))
            found = found[-count:]
    return found


@torch.inference_mode()
def nll(target, ids: list[int], mask: list[int]) -> tuple[float, int]:
    """Summed negative log-likelihood of the masked tokens given everything before them, and their count."""
    engine = target.engine
    cache = engine.new_cache(len(ids))
    n = len(ids)
    hidden = engine(torch.tensor([ids]), torch.arange(n)[None], causal_from(0, n), cache, 0)[0]
    rows = [i for i in range(1, n) if mask[i]]
    logits = engine.logits(hidden[[i - 1 for i in rows]]).float()
    logp = torch.log_softmax(logits, dim=-1)[torch.arange(len(rows)), torch.tensor([ids[i] for i in rows])]
    return -float(logp.sum()), len(rows)


@torch.inference_mode()
def teacher_forced_agreement(target, prompt: list[int], answer: list[int]) -> float:
    """Share of ``answer``'s positions where ``target``'s argmax given the prompt and the answer so far is the next
    answer token."""
    engine = target.engine
    ids = prompt + answer
    n = len(ids)
    hidden = engine(torch.tensor([ids]), torch.arange(n)[None], causal_from(0, n), engine.new_cache(n), 0)[0]
    top = engine.logits(hidden[len(prompt) - 1 : n - 1]).argmax(-1).tolist()
    return sum(a == b for a, b in zip(top, answer, strict=True)) / len(answer)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--weights", default="int8,int4",
                   help="comma list of low-bit weights to compare to fp32 (default int8,int4)")  # fmt: skip
    p.add_argument("--limit", type=int, default=10, help="prompts per dataset (MT-Bench, HumanEval; default 10)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--conversations", type=int, default=40, help="held-out ShareGPT conversations (default 40)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per conversation at most (default 512)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    env = environment(args.threads)
    reference = load_target(args.model, dtype="float32", weights="native")
    targets = {w: load_target(args.model, dtype="float32", weights=w) for w in args.weights.split(",") if w}
    env["served"] = {w: t.describe() for w, t in targets.items()}
    items = prompts(reference.tokenizer, args.limit)
    texts = held_out(reference.tokenizer, args.conversations, args.seq_len)
    bar = tqdm(total=len(items) * (1 + 2 * len(targets)) + len(texts) * (1 + len(targets)), desc="quality",
               file=sys.stderr)  # fmt: skip
    greedy: dict[str, list[dict]] = {w: [] for w in targets}
    for name, ids in items:
        want = generate(LocalVerifier(reference), NoDrafter(), ids, args.max_new_tokens).token_ids
        bar.update()
        for w, target in targets.items():
            got = generate(LocalVerifier(target), NoDrafter(), ids, args.max_new_tokens).token_ids
            diff = first_difference(got, want)
            bar.update()
            agree = teacher_forced_agreement(target, ids, want) if want else 1.0
            bar.update()
            greedy[w].append({"prompt": name, "tokens": len(want), "first_difference": diff, "top1_agreement": agree})
    ppl: dict[str, dict] = {}
    for w, target in [("fp32", reference), *targets.items()]:
        total, count = 0.0, 0
        for ids, mask in texts:
            s, c = nll(target, ids, mask)
            total, count = total + s, count + c
            bar.update()
        ppl[w] = {"perplexity": math.exp(total / count), "tokens": count}
    bar.close()
    summary = {}
    for w, rows in greedy.items():
        firsts = [r["first_difference"] if r["first_difference"] is not None else r["tokens"] for r in rows]
        summary[w] = {
            "identical": sum(r["first_difference"] is None for r in rows) / len(rows),
            "median_first_difference": statistics.median(firsts),
            "top1_agreement": statistics.mean(r["top1_agreement"] for r in rows),
            "perplexity": ppl[w]["perplexity"],
        }
    result = {"environment": env, "settings": vars(args) | {"out": str(args.out)}, "summary": summary,
              "perplexity": ppl, "greedy": greedy}  # fmt: skip
    lines = [
        f"Quality against fp32 on {env['cpu']} ({env['date']}; `{env['command']}`): {len(items)} prompts "
        f"(MT-Bench + HumanEval, {args.max_new_tokens} greedy tokens), perplexity over {ppl['fp32']['tokens']} "
        f"assistant tokens of {len(texts)} held-out ShareGPT conversations (fp32: {ppl['fp32']['perplexity']:.3f}).",
        "",
        "| weights | prompts identical over all tokens | median first differing token | teacher-forced top-1 "
        "agreement | perplexity (fp32 = {:.3f}) |".format(ppl["fp32"]["perplexity"]),
        "|---|---:|---:|---:|---:|",
    ]
    for w, s in summary.items():
        lines.append(f"| {w} | {s['identical']:.0%} | {s['median_first_difference']:g} | {s['top1_agreement']:.1%} | "
                     f"{s['perplexity']:.3f} ({s['perplexity'] / ppl['fp32']['perplexity'] - 1:+.1%}) |")  # fmt: skip
    md = "\n".join(lines) + "\n"
    save_results(args.out, "quality", result, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
