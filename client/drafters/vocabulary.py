"""A whole model's draft vocabulary when serving: read from a ranking, never counted here.

A model drafter's head costs E·V a drafted token; cut to the few thousand tokens an assistant says most, it costs a
fraction. Which tokens those are is a ranking counted once per tokenizer over training conversations
(``client.training.vocab.count_ranking``, ``python -m client.training.vocab MODEL``) and read here: shipped with
splitspec (``SHIPPED``: the pair's Qwen2.5 tokenizer) or kept in the cache. Serving never opens a dataset. A
tokenizer nobody counted for falls back on its own order: BPE and SentencePiece number their tokens by merge rank or
score, so low ids are the frequent ones.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

RANKED = 32768  # tokens a ranking keeps: any smaller vocabulary is a prefix of it
SHIPPED = Path(__file__).with_name("ranked")  # rankings counted once and committed: the pair's tokenizer's
SAMPLE = 2000  # conversations a ranking is counted over


def ranking_path(tokenizer, sample: int = SAMPLE, cache: str | os.PathLike | None = None) -> Path:
    """Where the ranking of ``tokenizer`` over ``sample`` conversations is: shipped, else in the cache
    (``vocab/<fingerprint>-<sample>.json``), which may not exist yet."""
    from shared.engine.files import cache_dir
    from shared.engine.target import tokenizer_fingerprint

    name = f"{tokenizer_fingerprint(tokenizer)}-{sample}.json"
    return SHIPPED / name if (SHIPPED / name).is_file() else Path(cache_dir(cache)) / "vocab" / name


def frequent_tokens(tokenizer, size: int, cache: str | os.PathLike | None = None, sample: int = SAMPLE) -> torch.Tensor:
    """The ``size`` tokens (at most ``RANKED``) ranked first for this tokenizer, with its special tokens, sorted: a
    whole model's draft vocabulary. Without a ranking, its ``size`` lowest ids (see the module docstring)."""
    if not 1 <= size <= RANKED:
        raise ValueError(f"a draft vocabulary of {size} tokens; expected 1..{RANKED}")
    path = ranking_path(tokenizer, sample, cache)
    try:
        ranked = json.loads(path.read_text())
    except (OSError, ValueError):
        print(f"splitspec: no draft vocabulary ranking for this tokenizer ({path.name}); drafting from its {size} "
              "lowest ids (`python -m client.training.vocab MODEL` counts one)", file=sys.stderr)  # fmt: skip
        ranked = range(min(size, len(tokenizer)))
    chosen = set(tokenizer.all_special_ids) | set(ranked[:size])
    return torch.tensor(sorted(chosen), dtype=torch.long)
