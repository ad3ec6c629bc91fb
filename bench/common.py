"""What every benchmark records next to its numbers (the machine and the command that made them), and shared helpers."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shared.engine.kernels import cpu_label


@dataclass
class Timed:
    """One timed generation: the numbers every generating bench's JSON has (a bench's ``Run`` adds its own)."""

    dataset: str
    prompt: int  # position within its dataset
    method: str
    tokens: int
    wall_s: float
    tokens_per_s: float
    acceptance_length: float
    rounds: int


def machine() -> dict:
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_label(),  # model and vector ISAs: the machines alternate
        "cpu_count": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0],
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(sys.orig_argv),
    }


def environment(threads: int, device: str = "cpu") -> dict:
    """The machine plus the library versions and torch threads a model benchmark ran with; on a GPU its name, and
    no CPU kernel build (asking for one would build them all: minutes, for a run that never used them)."""
    import torch
    import transformers

    from shared.engine import kernels

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "threads": threads}
    if str(device).startswith("cuda"):
        return {**env, "gpu": torch.cuda.get_device_name(torch.device(device)), **machine()}
    build = kernels.active() if kernels.available() else None  # the kernel build that ran (chosen by timing)
    return {**env, "kernels": build, **machine()}


def start(threads: int) -> None:
    """A model benchmark's first step: tokenizers that do not start threads of their own, torch on ``threads``."""
    import torch

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(threads)


def scrape(port: int) -> dict[str, float]:
    """A server's Prometheus figures (``--metrics-port``), unlabelled ones, by name."""
    import urllib.request

    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    values = {}
    for line in body.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def metrics_port(log: Path) -> int:
    """The port a server child started with ``--metrics-port 0`` serves its metrics on, from its log."""
    return int(next(line.rsplit(":", 1)[1].split("/")[0] for line in log.read_text().splitlines()
                    if "metrics on http" in line))  # fmt: skip


def served_target(model: str):
    """The target as ``splitspec serve`` serves it here (``auto``: one path per model and machine), and its dtype."""
    from shared.engine.models import load_target

    target = load_target(model, dtype="auto")
    return target, str(target.dtype).removeprefix("torch.")


def finish(out: Path, stem: str, result: dict, markdown: str, table: str | None = None, notes: list[str] = (),
           png: bool = True) -> int:  # fmt: skip
    """The last step: ``stem``.json and .md saved (``save_results``), ``table`` printed (default: the markdown),
    then ``notes`` (warnings) and which files were written (the PNG is the benchmark's own to draw). Returns 0."""
    save_results(out, stem, result, markdown)
    print(markdown if table is None else table)
    for note in notes:
        print(f"\n{note}", file=sys.stderr)
    print(f"\nwrote {out}/{stem}.{{json,md{',png' if png else ''}}}", file=sys.stderr)
    return 0


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None when equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def mark_differences(done: dict[str, tuple[object, list[int]]], reference: str, where: str) -> None:
    """Check each run's greedy ids against ``reference``'s: {method: (run, ids)}; sets the runs'
    ``first_difference`` and ``matches_reference`` and warns (never fails) on a difference."""
    from tqdm import tqdm

    ref_ids = done[reference][1]
    for name, (run, ids) in done.items():
        if name == reference:
            continue
        run.first_difference = first_difference(ids, ref_ids)
        run.matches_reference = run.first_difference is None
        if not run.matches_reference:
            tqdm.write(
                f"WARNING: {where}: {name} differs from {reference} at token {run.first_difference} "
                f"({len(ids)} vs {len(ref_ids)} tokens)",
                file=sys.stderr,
            )


def bundle_problem(name: str, target) -> str | None:
    """Why drafter ``name`` cannot draft for ``target``: a trained drafter with no bundle of that name, or whose
    bundle was made for another target (the 1.5B's ``eagle`` on the 0.5B, which shares its tokenizer); None when it
    can, or when ``name`` is no bundle (training-free, or a whole model: those are checked as they are made)."""
    from client.drafters import needs_target
    from client.drafters.bundle import find_bundle
    from shared.bundles import read_bundle
    from shared.errors import SplitspecError

    if not needs_target(name):
        return None
    path = find_bundle(name, target)
    if path is None:
        return f"no bundle {name!r}: neither a shipped one nor a folder"
    try:
        read_bundle(path, target)
    except SplitspecError as exc:
        return str(exc)
    return None


def drop_unusable(methods: list[str], target, drafter_of: Callable[[str], str | None]
                  ) -> tuple[list[str], dict[str, str]]:  # fmt: skip
    """``methods`` less those whose drafter cannot draft for ``target`` (``bundle_problem``), each warned about, and
    {method: why} for those; ``drafter_of`` names a method's drafter (None: it has none, as the API)."""
    skipped = {}
    for method in methods:
        drafter = drafter_of(method)
        why = bundle_problem(drafter, target) if drafter is not None else None
        if why is not None:
            skipped[method] = why
            print(f"WARNING: skipping {method}: {why}", file=sys.stderr)
    return [m for m in methods if m not in skipped], skipped


def skipped_note(skipped: dict[str, str]) -> str:
    """The header's paragraph naming the methods a bench skipped, and why ("" where none was)."""
    return "Skipped: " + "; ".join(f"{m} ({why})" for m, why in skipped.items()) + "\n\n" if skipped else ""


def median(values: list[float]) -> float | None:
    """The median rounded to 3 decimals, None for no values."""
    return round(statistics.median(values), 3) if values else None


def cell(value: float | None, fmt: str) -> str:
    """A markdown table cell: ``value`` formatted, or an en dash for None."""
    return "–" if value is None else format(value, fmt)


def times(ratio: float | None) -> str:
    """A ratio's markdown cell: ``1.23×``, or an en dash for None."""
    return "–" if ratio is None else f"{ratio:.2f}×"


def share(value: float | None) -> str:
    """A share's markdown cell: ``42%``, or an en dash for None."""
    return "–" if value is None else f"{value:.0%}"


def table(columns: list[str], rows: list[list[str]], left: int = 1) -> str:
    """A markdown table of ``rows`` under ``columns``: the first ``left`` columns text, the others numbers (aligned
    right)."""
    rule = "|" + "---|" * left + "---:|" * (len(columns) - left)
    return "\n".join(["| " + " | ".join(columns) + " |", rule, *("| " + " | ".join(row) + " |" for row in rows)])


def save_results(out: Path, stem: str, result: dict, markdown: str) -> None:
    """``out/stem.json`` (the whole result) and ``out/stem.md`` (the human-readable table)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2, default=str, ensure_ascii=False) + "\n")
    (out / f"{stem}.md").write_text(markdown + "\n")


def save_figure(fig, path: Path, title: str | None = None) -> None:
    """Lay out, title (when given), write and free a matplotlib figure."""
    import matplotlib.pyplot as plt

    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)  # drawn before ``finish`` saves the numbers beside it
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_clients(client, n: int) -> float:
    """``client(i)`` for i in 0..n-1, each on a thread of its own, all at once; returns the wall seconds until the
    last one ended."""
    import threading
    import time

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def clients_figure(series: dict[str, tuple[list, list, list | None]], left: str, right: str, path: Path,
                   title: str) -> None:  # fmt: skip
    """Two panels against the number of concurrent clients (log 2): ``series`` {label: (clients, left values, right
    values or None to leave it out of the right panel)}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for label, (xs, ys, zs) in series.items():
        a.plot(xs, ys, marker="o", label=label)
        if zs is not None:
            b.plot(xs, zs, marker="o", label=label)
    for ax, name in ((a, left), (b, right)):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(name)
        ax.legend()
        ax.grid(alpha=0.3)
    save_figure(fig, path, title)


def stream_bytes(target) -> int:
    """Bytes of weights a token's forward reads: every linear layer's (packed weights and their scales where low-bit,
    the LM head's included; a tied head once). Plain decoding streams them all once a token, so over
    ``kernels.read_peak`` they bound its rate on a CPU."""
    from shared.engine.linear import Linear

    seen: dict[int, int] = {}
    for m in target.engine.modules():
        if isinstance(m, Linear):
            tensors = [m.qweight, m.qscale] if m.qweight is not None else [m.weight, m.bias]
            seen |= {t.data_ptr(): t.nbytes for t in tensors if t is not None}
    return sum(seen.values())
