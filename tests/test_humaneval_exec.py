"""bench.humaneval: a chat reply becomes a program that passes or fails the problem's own tests."""

from __future__ import annotations

import pytest

from bench.humaneval import passes, program_for
from client.training.datasets import humaneval_problems


@pytest.fixture(scope="module")
def problem() -> dict:
    return humaneval_problems()[0]  # has_close_elements(numbers, threshold), with a typing import


def fenced(code: str) -> str:
    return f"Here is the function:\n\n```python\n{code}```\n\nIt compares every pair."


def test_the_canonical_body_passes_and_a_wrong_one_fails(problem):
    assert passes(problem, fenced(problem["canonical_solution"]))  # the body alone: the stub goes in front
    assert not passes(problem, fenced("    return False\n"))


def test_a_whole_function_gets_the_stub_imports_and_a_cut_off_fence_still_counts(problem):
    whole = problem["prompt"][problem["prompt"].index("def ") :] + problem["canonical_solution"]
    program = program_for(problem, fenced(whole).removesuffix("\n\nIt compares every pair.").removesuffix("```"))
    assert "from typing import List" in program and program.count("def has_close_elements") == 1
    assert passes(problem, "```python\n" + whole)  # the token budget ended inside the code block


def test_a_program_that_never_ends_fails_by_timeout(problem):
    assert not passes(problem, fenced("    while True:\n        pass\n"), timeout_s=1.0)
