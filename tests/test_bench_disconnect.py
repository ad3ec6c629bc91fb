"""bench.disconnect's cut: it must see every round that verifies tokens, chained ones included."""

from __future__ import annotations

from types import SimpleNamespace

from bench.disconnect import CutAfter
from client.verifiers import Pending


class Link:
    def __init__(self):
        self.cuts = []

    def cut(self, silent: bool) -> None:
        self.cuts.append(silent)


class Verifier:
    """Each round verifies 3 tokens; a chained round's verdict comes when taken."""

    def open(self, *args, **kwargs):
        return SimpleNamespace(new_tokens=[1])

    def verify(self, tree, **kwargs):
        return SimpleNamespace(new_tokens=[1, 2, 3])

    def verify_after(self, length, assumed, tree, **kwargs):
        return Pending(lambda: SimpleNamespace(new_tokens=[1, 2, 3]), lambda: None, lambda: True)


def test_chained_rounds_count_and_cut_the_link():
    link = Link()
    verifier = Verifier()
    cutter = CutAfter(verifier, link, 7)
    verifier.open()  # 1 token
    verifier.verify(None)  # 4
    pending = verifier.verify_after(4, [1, 2, 3], None)  # sent before 7: no cut yet
    assert cutter.cut_at is None and not link.cuts
    pending.verdict()  # 7
    assert cutter.produced == 7
    pending = verifier.verify_after(7, [1, 2, 3], None)  # the first round after 7 tokens: cut before it
    assert link.cuts == [True] and cutter.cut_at == 7
    pending.verdict()  # a reply already on its way when the link went still counts as verified
    assert cutter.cut_at == 10
    verifier.verify(None)
    assert link.cuts == [True]  # cut once
