"""The decode loop's data flows one way, checked on the source (so a shortcut fails here whatever the inputs):
the loop knows a policy only by the ``Policy`` interface and never stands ``None`` in for one; each field of its
output has one writer (``Run.commit``); the offline stage reads a ``Cut`` and yields outputs, writing nothing of
the loop's."""

from __future__ import annotations

import ast
from pathlib import Path

from client.loop.adaptive import Policy

ROOT = Path(__file__).resolve().parents[1]


def parsed(name: str) -> ast.Module:
    return ast.parse((ROOT / name).read_text())


def test_the_loop_knows_a_policy_only_by_its_interface():
    interface = {n for n in vars(Policy) if not n.startswith("_")}
    assert interface == {"plan", "size", "observe", "calibration", "estimate", "survival"}
    used = set()
    for node in ast.walk(parsed("client/loop/decode.py")):
        if isinstance(node, ast.Attribute) and (
            (isinstance(node.value, ast.Name) and node.value.id == "policy")
            or (isinstance(node.value, ast.Attribute) and node.value.attr == "policy")
        ):
            used.add(node.attr)
    assert used and used <= interface, used - interface


def test_no_policy_is_none_anywhere_in_the_client():
    """A static policy is a policy (``StaticPolicy``): no branch stands in for one."""
    found = []
    for path in sorted((ROOT / "client").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
                sides = [node.left, *node.comparators]
                named = any(isinstance(s, ast.Attribute | ast.Name) and getattr(s, "attr", getattr(s, "id", ""))
                            == "policy" for s in sides)  # fmt: skip
                if named and any(isinstance(s, ast.Constant) and s.value is None for s in sides):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []


def test_the_output_has_one_writer():
    """``out`` and ``verified`` of the loop are assigned in ``Run.commit`` alone."""
    writers = []
    for cls in (n for n in parsed("client/loop/decode.py").body if isinstance(n, ast.ClassDef) and n.name == "Run"):
        for method in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
            for node in ast.walk(method):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                    node, ast.AugAssign | ast.AnnAssign) else []  # fmt: skip
                for t in targets:
                    for leaf in ast.walk(t):
                        if isinstance(leaf, ast.Attribute) and leaf.attr in ("out", "verified"):
                            writers.append(method.name)
    assert set(writers) == {"__init__", "commit"}, writers


def test_the_offline_stage_writes_nothing_of_the_loop():
    """``client.loop.offline`` assigns attributes only of its own objects (``self``, its stats), never of the ``Cut`` it
    was handed, and does not import the loop."""
    module = parsed("client/loop/offline.py")
    foreign = []
    for node in ast.walk(module):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AugAssign | ast.AnnAssign) else []  # fmt: skip
        for t in targets:
            if isinstance(t, ast.Attribute):
                owner = t.value
                while isinstance(owner, ast.Attribute):
                    owner = owner.value
                if isinstance(owner, ast.Name) and owner.id not in ("self", "stats"):
                    foreign.append(f"{ast.unparse(t)}:{node.lineno}")
                elif isinstance(t.value, ast.Attribute) and t.value.attr == "cut":
                    foreign.append(f"{ast.unparse(t)}:{node.lineno}")
    imports = {n.module for n in ast.walk(module) if isinstance(n, ast.ImportFrom)}
    assert foreign == [] and "client.loop.decode" not in imports
