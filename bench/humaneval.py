"""HumanEval pass@1 of a chat reply: pull the program out, run the problem's tests in a subprocess.

The target answers "Complete this Python function: ```python <stub>```" (``bench.single``'s template)
with prose around a fenced code block, which may hold the whole function, only its body, or be cut
off by the token budget (no closing fence). The program run is the first fenced block (to its end,
or to the end of the text), after the stub's own header lines (its imports) when the block defines
the function, or after the whole stub when it does not; then the problem's ``check`` function.
Each program runs in a fresh interpreter (``-I``: no user site, no environment), in an empty
temporary folder, under a timeout: generated code is untrusted and may loop.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.S)


def program_for(problem: dict, reply: str) -> str:
    """The Python file that tests ``reply`` against ``problem`` (``prompt``, ``test``, ``entry_point``)."""
    match = FENCE.search(reply)
    code = match.group(1) if match else reply
    stub, entry = problem["prompt"], problem["entry_point"]
    if re.search(rf"^\s*def {re.escape(entry)}\s*\(", code, re.M):
        header = stub[: stub.find(f"def {entry}")]  # imports and helpers the stub defines before the function
        code = header + "\n" + code
    else:
        code = stub + code
    return f"{code}\n\n{problem['test']}\n\ncheck({entry})\n"


def passes(problem: dict, reply: str, timeout_s: float = 10.0) -> bool:
    """Does the program made of ``reply`` pass the problem's tests within ``timeout_s``?"""
    with tempfile.TemporaryDirectory(prefix="splitspec-humaneval-") as tmp:
        path = Path(tmp) / "program.py"
        path.write_text(program_for(problem, reply))
        try:
            done = subprocess.run([sys.executable, "-I", str(path)], cwd=tmp, capture_output=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return False
    return done.returncode == 0
