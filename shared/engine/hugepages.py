"""The weights a CPU forward streams, held in 2 MB pages.

A one-token forward reads every weight once, at the memory's pace, and in 4 KB pages that stream misses the TLB
every 4 KB (a page walk each, nested under a hypervisor). Memory-mapped files (the packed-weight cache, safetensors)
stay in 4 KB pages, so ``hold`` copies what a forward multiplies by into anonymous memory advised
``MADV_HUGEPAGE``. The same bytes: outputs do not change. The price is that processes no longer share the page
cache's copy; ``SPLITSPEC_HUGE_PAGES=0``, or a kernel whose transparent huge pages are ``never``, keeps the mapping.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from pathlib import Path

import torch
from torch import nn

HUGE = 1 << 21  # a huge page
ALIGN = 64  # each tensor starts on a cache line
SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def available() -> bool:
    """Whether ``hold`` copies: Linux with transparent huge pages ``always`` or ``madvise``, not turned off by
    ``SPLITSPEC_HUGE_PAGES=0``."""
    if os.environ.get("SPLITSPEC_HUGE_PAGES", "1") == "0" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in SETTING.read_text()
    except OSError:
        return False


def arena(size: int) -> memoryview:
    """``size`` bytes of fresh anonymous memory advised ``MADV_HUGEPAGE``, starting on a huge page. Private, not
    shared: a shared anonymous mapping is shmem, which takes huge pages only by its own setting."""
    area = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # (a kernel built without huge pages: plain pages, the same bytes)
        area.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: the pages are made huge as they fault in
    start = -ctypes.addressof(ctypes.c_char.from_buffer(area)) % HUGE
    return memoryview(area)[start : start + size]  # (a view keeps its mmap alive)


def hold(model: nn.Module, least: int = HUGE) -> int:
    """Copy what ``model``'s projections multiply by on a CPU — packed weights and scales, else the float weight (a
    tied head's included) — into one ``arena``, each tensor ``ALIGN``-aligned, if they come to ``least`` bytes; the
    bytes moved (0 where the arena could not be had). A float weight kept beside packed ones (an embedding table: a
    forward reads a few of its rows) stays where it is."""
    if not available():
        return 0
    places, seen, size = [], set(), 0
    for m in model.modules():
        if not isinstance(m, nn.Linear):
            continue
        for name in ("qweight", "qscale") if getattr(m, "qweight", None) is not None else ("weight",):
            t = getattr(m, name)
            if t is None or t.device.type != "cpu" or not t.numel() or id(t) in seen:
                continue
            seen.add(id(t))
            places.append((m, name, t, size))
            size += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    if not places or size < least:
        return 0
    try:
        memory = arena(size)
    except OSError:  # no room for a second copy: the mapped weights serve as they are
        return 0
    for m, name, t, at in places:
        held = torch.frombuffer(memory[at : at + t.numel() * t.element_size()], dtype=t.dtype).view(t.shape)
        held.copy_(t.detach())
        if isinstance(t, nn.Parameter):
            t.data = held  # the Parameter object stays: a tied embedding shares it
        else:
            setattr(m, name, held)
    return size


def held_bytes() -> int:
    """Bytes of this process's anonymous memory in huge pages (``AnonHugePages`` of ``/proc/self/smaps_rollup``)."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
