"""Pre-tokenised training data: the training stream written once to numpy shards, read back for free.

Tokenising a conversation in the chat template costs ~a millisecond of Python; on a GPU that trains
tens of thousands of tokens a second, doing it on the fly would leave the device waiting. So a run can
write the stream's sequences to a folder once (``write_shards``: per shard of ``PER_SHARD`` sequences, the
ids as uint32, the loss mask as uint8 and the offsets, each a ``.npy`` file; a ``meta.json`` says what made
them) and read them with ``ShardStream``, which yields the same ``(input_ids, loss_mask)`` pairs in the same
order from memory-mapped files and resumes at a position like ``TrainingStream``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tqdm import tqdm

from shared.errors import SplitspecError

PER_SHARD = 20_000
META = "meta.json"


def write_shards(stream, folder: Path, sequences: int | None = None, tokens: int | None = None,
                 progress: bool = True, about: dict | None = None, per_shard: int | None = None,
                 resume: bool = False) -> dict:  # fmt: skip
    """Write the next ``sequences`` sequences of ``stream`` (or as many as hold ``tokens`` tokens) to ``folder``.

    ``about`` (seq_len, seed, tokenizer fingerprint, ...) goes into the meta file, so a run can tell
    whether shards fit it. Each shard is written to a temporary name and renamed, and the meta file is
    rewritten after it (with ``complete`` false until the end and the stream's ``position``): a slow stream
    (self-distillation) loses at most a shard when stopped, and ``resume`` continues such a folder — the
    caller makes ``stream`` start at the meta's ``position``. ``per_shard`` sequences per file (default
    ``PER_SHARD``).
    """
    if (sequences is None) == (tokens is None):
        raise ValueError("write_shards needs exactly one of sequences and tokens")
    per_shard = per_shard or PER_SHARD
    folder.mkdir(parents=True, exist_ok=True)
    old = read_meta(folder) if resume else None
    files = list(old["files"]) if old else []
    count, total = (old["sequences"], old["tokens"]) if old else (0, 0)
    bar = tqdm(total=sequences or tokens, initial=count if sequences else total, unit="seq" if sequences else "tok",
               unit_scale=True, disable=not progress, desc="writing shards")  # fmt: skip
    ids: list[int] = []
    mask: list[int] = []
    offsets = [0]

    def write_meta(complete: bool) -> dict:
        meta = {"files": files, "sequences": count, "tokens": total, "complete": complete,
                "position": getattr(stream, "position", None), **(about or {})}  # fmt: skip
        tmp = folder / f".{META}.tmp"
        tmp.write_text(json.dumps(meta, indent=1))
        tmp.rename(folder / META)
        return meta

    def flush() -> None:
        name = f"shard-{len(files):05d}"
        for part, array in (("ids", np.asarray(ids, dtype=np.uint32)), ("mask", np.asarray(mask, dtype=np.uint8)),
                            ("offsets", np.asarray(offsets, dtype=np.int64))):  # fmt: skip
            tmp = folder / f".{name}.{part}.tmp.npy"
            np.save(tmp, array)
            tmp.rename(folder / f"{name}.{part}.npy")
        files.append(name)
        ids.clear()
        mask.clear()
        del offsets[1:]
        write_meta(complete=False)

    while (sequences is not None and count < sequences) or (tokens is not None and total < tokens):
        seq, m = next(stream)
        ids.extend(seq)
        mask.extend(m + [0] * (len(seq) - len(m)))
        offsets.append(len(ids))
        count, total = count + 1, total + len(seq)
        bar.update(1 if sequences else len(seq))
        if len(offsets) - 1 == per_shard:
            flush()
    if len(offsets) > 1:
        flush()
    bar.close()
    return write_meta(complete=True)


def read_meta(folder: Path) -> dict | None:
    path = folder / META
    return json.loads(path.read_text()) if path.is_file() else None


class ShardStream:
    """An endless, resumable stream of the sequences in ``folder`` (from ``write_shards``), in order, cycling."""

    def __init__(self, folder: Path, skip: int = 0):
        meta = read_meta(folder)
        if meta is None or not meta["files"]:
            raise SplitspecError(f"{folder} holds no training shards (no {META}); write them with write_shards")
        self.shards = [{part: np.load(folder / f"{f}.{part}.npy", mmap_mode="r") for part in ("ids", "mask", "offsets")}
                       for f in meta["files"]]  # fmt: skip
        self.sizes = [len(s["offsets"]) - 1 for s in self.shards]
        self.total = sum(self.sizes)
        self.position = skip

    def __iter__(self) -> ShardStream:
        return self

    def __next__(self) -> tuple[list[int], list[int]]:
        i = self.position % self.total
        self.position += 1
        for shard, size in zip(self.shards, self.sizes, strict=True):
            if i < size:
                a, b = shard["offsets"][i], shard["offsets"][i + 1]
                return shard["ids"][a:b].tolist(), shard["mask"][a:b].tolist()
            i -= size
        raise AssertionError("unreachable: i < total")
