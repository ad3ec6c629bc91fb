"""Weights held in huge pages (shared/engine/hugepages.py): the same values where the kernels read them."""

from __future__ import annotations

import pytest
import torch

from shared.engine import hugepages
from shared.engine.linear import Linear
from shared.engine.models import load_target


@pytest.fixture
def huge_pages_on(monkeypatch, tmp_path):
    """The kernel's setting read as ``madvise`` whatever this machine's is (where it lacks huge pages, the arena is
    plain pages: the placement tested here is the same)."""
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    monkeypatch.setattr(hugepages, "SETTING", setting)
    monkeypatch.delenv("SPLITSPEC_HUGE_PAGES", raising=False)


def _spans(tensors):
    return sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)


@pytest.mark.parametrize("weights", ["native", "int4"])
def test_hold_moves_what_the_projections_read_into_one_arena(tiny_model_dir, huge_pages_on, weights):
    """Every projection's packed weight and scales (else its float weight) lands in one arena that starts on a huge
    page, each tensor cache-line aligned and none overlapping; the embeddings stay; the logits do not change."""
    from shared.engine import kernels

    if weights != "native" and not kernels.available():
        pytest.skip(f"no CPU kernels: {kernels.unavailable_reason()}")
    target = load_target(str(tiny_model_dir), dtype="float32", weights=weights)  # (too small: prepare moved nothing)
    engine = target.engine
    ids = torch.tensor([[5, 17, 42, 8, 99]])
    with torch.no_grad():
        before = engine.logits(engine(ids, torch.arange(5)[None], None, engine.new_cache(16), 0)[0])
    embeddings = engine.embed_tokens.weight.data_ptr()
    layers = [m for m in engine.modules() if isinstance(m, Linear)]
    read = [t for m in layers for t in ((m.qweight, m.qscale) if m.qweight is not None else (m.weight,))]
    moved = hugepages.hold(engine, least=0)
    now = [t for m in layers for t in ((m.qweight, m.qscale) if m.qweight is not None else (m.weight,))]
    assert moved >= sum(t.numel() * t.element_size() for t in read)
    spans = _spans(now)
    assert spans[0][0] % hugepages.HUGE == 0 and spans[-1][1] - spans[0][0] <= moved
    assert all(a % hugepages.ALIGN == 0 for a, _ in spans)
    assert all(b <= a2 for (_, b), (a2, _) in zip(spans, spans[1:], strict=False))
    assert all(torch.equal(a, b) for a, b in zip(read, now, strict=True))
    assert engine.embed_tokens.weight.data_ptr() == embeddings
    with torch.no_grad():
        after = engine.logits(engine(ids, torch.arange(5)[None], None, engine.new_cache(16), 0)[0])
    assert torch.equal(before, after)


def test_a_tied_head_stays_tied(huge_pages_on):
    """A head that is the embedding table (the same Parameter) moves once, and both still read it."""
    embed, head = torch.nn.Embedding(300, 64), Linear(64, 300, bias=False)
    head.weight = embed.weight
    model = torch.nn.ModuleList([embed, head])
    want = embed.weight.detach().clone()
    assert hugepages.hold(model, least=0) == 300 * 64 * 4
    assert head.weight is embed.weight and embed.weight.data_ptr() % hugepages.HUGE == 0
    assert torch.equal(embed.weight, want)


def test_turned_off_or_out_of_memory_nothing_moves(huge_pages_on, monkeypatch):
    """``SPLITSPEC_HUGE_PAGES=0`` keeps the weights where they were loaded (memory-mapped: shared between
    processes), and so does an arena the system refuses (no room for a second copy)."""
    layer = Linear(512, 2048)
    where = layer.weight.data_ptr()

    def refused(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(hugepages.mmap, "mmap", refused)
    assert hugepages.available() and hugepages.hold(layer) == 0 and layer.weight.data_ptr() == where
    monkeypatch.setenv("SPLITSPEC_HUGE_PAGES", "0")
    assert not hugepages.available() and hugepages.hold(layer) == 0 and layer.weight.data_ptr() == where


def test_on_a_kernel_with_huge_pages_the_arena_is_in_them():
    """Where this machine's kernel gives huge pages on advice (``madvise`` or ``always``), an arena of 8 MB is backed by
    them once touched: the point of it all."""
    if not hugepages.available():
        pytest.skip(f"transparent huge pages off here: {hugepages.SETTING}")
    layer = Linear(1024, 2048, bias=False)  # 8 MB of fp32
    before = hugepages.held_bytes()
    assert hugepages.hold(layer) == 8 << 20
    assert hugepages.held_bytes() - before >= 2 * hugepages.HUGE
