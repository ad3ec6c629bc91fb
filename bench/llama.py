"""llama.cpp beside us on the same GGUFs, for the tables only (never a dependency): its plain decoding speed
(``llama-bench``) and its own speculative decoding with a draft model (``llama-speculative -md``).

``make llama-bench`` builds both binaries; a benchmark runs them when ``$LLAMA_BENCH`` / ``$LLAMA_SPECULATIVE`` (or
its flags) name them.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass

_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_FIELD = re.compile(r"\b(n_draft|n_predict|n_drafted|n_accept)\s*=\s*(\d+)")


@dataclass
class Speculative:
    """One ``llama-speculative`` generation: what it printed, as numbers."""

    tokens: int
    seconds: float
    drafted: int
    accepted: int
    draft_max: int

    @property
    def tokens_per_s(self) -> float:
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
    return Speculative(int(decoded.group(1)), float(decoded.group(2)), fields.get("n_drafted", 0),
                       fields.get("n_accept", 0), fields.get("n_draft", draft_max))  # fmt: skip


def plain_tokens_per_s(binary: str, gguf: str, max_new_tokens: int, threads: int, repeats: int = 3) -> float:
    """``llama-bench``'s decoding speed (tg``max_new_tokens``, no prompt): llama.cpp's plain decoding."""
    cmd = [binary, "-m", gguf, "-t", str(threads), "-p", "0", "-n", str(max_new_tokens), "-r", str(repeats),
           "-o", "json"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr.strip()[-300:]}")
    return float(json.loads(done.stdout)[0]["avg_ts"])
