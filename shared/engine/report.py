"""``splitspec kernels``: this CPU's kernel builds and serving paths timed on a model's shapes, and the one path
``--dtype auto --weights auto`` serves it on (``paths``, ``models.served_paths``)."""

from __future__ import annotations

import argparse
import json

import torch

from shared.engine import kernels, paths
from shared.engine.models import DEFAULT_MODEL, model_config, own_layers, resolve_model, served_paths


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="the model whose shapes are timed (default: the built-in target)")
    p.add_argument("--cache-dir", help="where converted models and timing tables are kept")
    p.add_argument("--refresh", action="store_true", help="measure again instead of reading the cached table")
    p.add_argument("--json", action="store_true", help="print the table as JSON")


def run(args: argparse.Namespace) -> int:
    spec = args.model or DEFAULT_MODEL
    folder = resolve_model(spec, args.cache_dir)
    cfg = model_config(folder)
    loaded = kernels.builds()
    seconds = kernels.time_builds([t for t in loaded if t != "portable"] or loaded) if loaded else {}
    peaks = {t: kernels.int8_peak(t) / 1e9 for t in loaded}
    read = kernels.read_peak() / 1e9 if loaded else None
    table = paths.table_for(cfg, args.cache_dir, refresh=args.refresh, own=own_layers(folder))
    allowed, why = served_paths(folder)
    chosen = table.choose(allowed)
    own = own_layers(folder, rounding=True)  # a GGUF's drafter packs its layers otherwise: a table of its own
    drafts = table if own is None else paths.table_for(cfg, args.cache_dir, refresh=args.refresh, own=own)
    drafting = drafts.choose(served_paths(folder, rounding=True)[0], paths.DRAFT_MIX)
    if args.json:
        print(json.dumps({**table.to_json(), "model": spec, "chosen": chosen, "candidates": allowed, "why": why,
                          "drafting": drafting,
                          "builds": {t: 1e3 * s for t, s in seconds.items()},
                          "int8_peak_g_per_s": peaks, "read_peak_gb_per_s": read}, indent=1))  # fmt: skip
        return 0
    print(f"# {spec} on {table.cpu}, {table.threads} threads (measured {table.measured})\n")
    print("Kernel builds (ms for an int4 and an int8 projection, 2048 x 4096, at 1 and 16 rows; the peak int8 "
          "multiply-adds a second of the build's multiply instruction alone):\n")
    for t in kernels.BUILDS:
        state = f"{1e3 * seconds[t]:.2f} ms" if t in seconds else (load_reason if (load_reason := kernels.load(t))
                                                                   else "built (not timed: slow)")  # fmt: skip
        peak = f", peak {peaks[t]:.0f} G/s" if t in peaks else ""
        print(f"  {t:12s} {state}{peak}{'   <- used' if t == kernels.active() else ''}")
    if read:
        print(f"\nMemory: {read:.1f} GB/s read on {torch.get_num_threads()} threads, the ceiling of a token's "
              "forward: every weight read once")
    print("\nPaths (one forward of the whole model after a 128-token prefix, extrapolated from a slice):\n")
    print(table.markdown())
    mix = " + ".join(map(str, paths.MIX))
    print(f"\nserved: {chosen}, the cheapest {mix}-token mix of {', '.join(allowed)} ({why}); "
          "every drafter, the server and plain decoding use it")
    draft_mix = " + ".join(map(str, paths.DRAFT_MIX))
    print(f"as a drafter: {drafting}, the cheapest {draft_mix}-token mix of any path (drafts never change an output)")
    return 0
