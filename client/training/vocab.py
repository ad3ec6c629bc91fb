"""The draft vocabulary: the tokens a drafter may propose, by frequency in what the target says.

A drafter's LM head costs E·V per drafted token; with the target's 49k vocabulary that is most
of a small drafter's time on a CPU, and of its training. Counting assistant tokens over training
conversations, the most frequent few thousand cover nearly all of them (``coverage`` says how
much); special tokens are always in, so a drafter can propose ending a turn.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from itertools import islice
from pathlib import Path

import torch

from client.drafters.vocabulary import RANKED, SAMPLE, ranking_path
from client.training.datasets import TrainingStream


def token_counts(tokenizer, sample: int = 3000, seq_len: int = 512, seed: int = 0, stream=None) -> Counter[int]:
    """How often each token is said by the assistant in ``sample`` training sequences (another order than
    training's, same data; or the first of ``stream``'s, e.g. pre-written shards on a machine without the dataset):
    count once, then cut vocabularies of several sizes from it."""
    counts: Counter[int] = Counter()
    stream = stream if stream is not None else TrainingStream(tokenizer, seq_len, seed=seed + 1)
    for ids, mask in islice(stream, sample):
        counts.update(t for t, m in zip(ids, mask, strict=True) if m)
    return counts


def draft_vocab(tokenizer, size: int, sample: int = 3000, seq_len: int = 512, seed: int = 0, extra: list[int] = (),
                counts: Counter[int] | None = None, stream=None) -> tuple[torch.Tensor, float]:  # fmt: skip
    """The ``size`` most frequent assistant tokens of ``sample`` training sequences (+ specials), sorted; and
    the share of those sample tokens they cover. ``counts`` (from ``token_counts``) saves counting again;
    ``stream`` counts its sequences instead of the dataset's (``token_counts``)."""
    if counts is None:
        counts = token_counts(tokenizer, sample, seq_len, seed, stream)
    special = set(tokenizer.all_special_ids) | set(extra)
    chosen = set(special)
    for token, _ in counts.most_common():
        if len(chosen) >= size:
            break
        chosen.add(token)
    total = sum(counts.values())
    coverage = sum(counts[t] for t in chosen) / total if total else 0.0
    return torch.tensor(sorted(chosen), dtype=torch.long), coverage


def count_ranking(tokenizer, sample: int = SAMPLE, cache: str | os.PathLike | None = None) -> Path:
    """Count which tokens an assistant says most in ``sample`` ShareGPT conversations (a download and a minute), and
    keep the first ``RANKED`` where serving reads them (``client.drafters.vocabulary``); its path. A shipped ranking
    is never counted again."""
    path = ranking_path(tokenizer, sample, cache)
    if path.is_file():
        return path
    print(f"splitspec: counting a draft vocabulary over {sample} ShareGPT conversations (once for this tokenizer)",
          file=sys.stderr)  # fmt: skip
    ranked = [t for t, _ in token_counts(tokenizer, sample).most_common(RANKED)]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(ranked))
    tmp.replace(path)  # whole or not at all: another process may be counting too
    return path


def main(argv: list[str] | None = None) -> int:
    import argparse

    from shared.engine.models import load_tokenizer

    p = argparse.ArgumentParser(prog="python -m client.training.vocab",
                                description="Count a tokenizer's draft vocabulary ranking, once, for model drafters.")
    p.add_argument("model", help="a model name, GGUF or Hugging Face folder whose tokenizer to count for")
    p.add_argument("--sample", type=int, default=SAMPLE, help=f"conversations to count over (default {SAMPLE})")
    p.add_argument("--cache-dir", help="where the ranking is kept (default the splitspec cache)")
    args = p.parse_args(argv)
    print(count_ranking(load_tokenizer(args.model, args.cache_dir), args.sample, args.cache_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
