"""One word per idea (docs/architecture.md, "Words"): public names say a concept with its glossary word, not a
synonym that a newcomer would take for another idea. The names are read from the source (``ast``), nothing is
imported: every module, class, function and method name that does not start with ``_``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("client", "server", "shared", "netsim")
# a word that is not ours -> the glossary's word for what it would mean here
SYNONYMS = {
    "continuation": "stretch (what the server decodes by itself)",
    "outage": "disconnect",
    "disconnection": "disconnect",
    "speculation": "draft / round",
    "candidate": "draft / tree",
    "proposal": "tree (what propose() returns)",
    "baseline_stream": "api (the API baseline)",
}


def public_names(root: Path = ROOT) -> list[tuple[str, str]]:
    """(where, name) of every public module, class, function and method of ``PACKAGES``."""
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            if "wire" in path.parts:  # generated
                continue
            where = str(path.relative_to(root))
            found.append((where, path.stem))
            for node in ast.walk(ast.parse(path.read_text(), where)):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    found.append((f"{where}:{node.lineno}", node.name))
    return [(w, n) for w, n in found if not n.startswith("_")]


def words(name: str) -> list[str]:
    """A name's words, lower case: snake_case and CamelCase split."""
    spaced = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name)
    return [w for w in spaced.lower().split("_") if w]


def test_the_names_are_read():
    names = dict((n, w) for w, n in public_names())
    assert "Stretches" in names and "RemoteVerifier" in names and "generate" in names
    assert words("RemoteVerifier") == ["remote", "verifier"] and words("api_tokens") == ["api", "tokens"]


def test_no_public_name_uses_a_synonym_of_a_glossary_word():
    misused = []
    for where, name in public_names():
        split = words(name)
        joined = "_".join(split)
        for synonym, ours in SYNONYMS.items():
            if synonym in split or ("_" in synonym and synonym in joined):
                misused.append(f"{where}: {name} says {synonym!r}; the glossary's word is {ours}")
    assert not misused, "\n".join(misused)
