"""llama.cpp beside us on the same GGUFs, for the tables only (never a dependency): its plain decoding speed
(``llama-bench``) and its own speculative decoding with a draft model (``llama-speculative -md``).

``make llama-bench`` builds both binaries; a benchmark runs them when ``$LLAMA_BENCH`` / ``$LLAMA_SPECULATIVE`` (or
its flags) name them.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_ENCODED = re.compile(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_FIELD = re.compile(r"\b(n_draft|n_predict|n_drafted|n_accept)\s*=\s*(\d+)")


@dataclass
class Speculative:
    """One ``llama-speculative`` generation: what it printed, as numbers."""

    tokens: int
    seconds: float  # decoding them (the prompt's prefill apart)
    drafted: int
    accepted: int
    draft_max: int
    prefill_s: float = 0.0  # the prompt's

    @property
    def tokens_per_s(self) -> float:
        """Decoding's pace, the prefill apart (what llama.cpp prints)."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def acceptance_length(self) -> float:
        """Tokens per verification round (τ), from its counts: each round drafts ``draft_max`` and gains the
        accepted drafts plus the target's own token."""
        rounds = self.drafted / self.draft_max if self.draft_max else 0
        return self.tokens / rounds if rounds else 1.0


def speculative(binary: str, target: str, draft: str, prompt: str, max_new_tokens: int, threads: int,
                draft_max: int = 5, timeout_s: float = 600.0) -> Speculative:  # fmt: skip
    """Greedy speculative decoding of ``prompt`` (text, chat template applied, special tokens written out) with
    ``llama-speculative``: ``draft`` proposes ``draft_max`` tokens a round for ``target``."""
    cmd = [binary, "-m", target, "-md", draft, "-p", prompt, "-n", str(max_new_tokens), "--temp", "0", "-t",
           str(threads), "--spec-draft-n-max", str(draft_max), "--seed", "1"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    out = done.stdout + done.stderr
    decoded = _DECODED.search(out)
    if done.returncode != 0 or decoded is None:
        tail = out.strip().splitlines()[-3:]
        raise RuntimeError(f"{binary} exited {done.returncode} without a 'decoded' line: {' | '.join(tail)}")
    fields = {k: int(v) for k, v in _FIELD.findall(out)}
    encoded = _ENCODED.search(out)
    return Speculative(int(decoded.group(1)), float(decoded.group(2)), fields.get("n_drafted", 0),
                       fields.get("n_accept", 0), fields.get("n_draft", draft_max),
                       float(encoded.group(2)) if encoded else 0.0)  # fmt: skip


def plain_tokens_per_s(binary: str, gguf: str, max_new_tokens: int, threads: int, repeats: int = 3) -> float:
    """``llama-bench``'s decoding speed (tg``max_new_tokens``, no prompt): llama.cpp's plain decoding."""
    cmd = [binary, "-m", gguf, "-t", str(threads), "-p", "0", "-n", str(max_new_tokens), "-r", str(repeats),
           "-o", "json"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr.strip()[-300:]}")
    return float(json.loads(done.stdout)[0]["avg_ts"])


def forward_costs(binary: str, ggufs: list[str], threads: int, repeats: int, sizes: list[int], prefix: int,
                  bar: tqdm) -> dict:  # fmt: skip
    """``llama-bench`` on each GGUF: decoding tok/s (tg128) and the ms of one batch of n tokens (each of ``sizes``)
    after a ``prefix``-token context (``-d``; after none in an old llama-bench), medians of ``repeats`` samples."""
    helptext = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60)
    has_depth = "--n-depth" in helptext.stdout + helptext.stderr
    batch = ["-p", ",".join(map(str, sizes)), "-n", "0", *(["-d", str(prefix)] if has_depth else [])]
    out: dict = {"binary": binary, "has_depth": has_depth, "commands": [], "rows": [], "errors": []}
    for gguf in ggufs:
        for test in (["-p", "0", "-n", "128"], batch):
            cmd = [binary, "-m", gguf, "-t", str(threads), "-r", str(repeats), "-o", "json", *test]
            bar.set_postfix_str(f"llama-bench {Path(gguf).name} {' '.join(test)}")
            out["commands"].append(" ".join(cmd))
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
                records = json.loads(done.stdout) if done.returncode == 0 else None
            except (subprocess.TimeoutExpired, json.JSONDecodeError) as exc:
                done, records = None, None
                out["errors"].append({"command": " ".join(cmd), "error": repr(exc)})
            if records is None:
                if done is not None:
                    out["errors"].append({"command": " ".join(cmd), "error": done.stderr.strip()[-500:]})
                tqdm.write(f"WARNING: llama-bench failed on {gguf}: {out['errors'][-1]['error']}", file=sys.stderr)
            for r in records or []:
                samples = r.get("samples_ns") or [r["avg_ns"]]
                ms = statistics.median(samples) / 1e6
                gen, prompt = r.get("n_gen", 0), r.get("n_prompt", 0)
                out["rows"].append({
                    "gguf": Path(gguf).name, "type": str(r.get("model_type", "")).split()[-1],
                    "n_prompt": prompt, "n_gen": gen, "n_depth": r.get("n_depth", 0),
                    "ms": round(ms, 3), "tokens_per_s": round(1000 * (gen or prompt) / ms, 3),
                })  # fmt: skip
            bar.update()
    return out
