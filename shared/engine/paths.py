"""Path timing: which exact path serves a model on this machine, chosen by timing each one (``--dtype auto
--weights auto``).

A CPU flag says what a CPU can execute, not what is fast on it: AVX512-BF16 without AMX streams bf16 weights
at bandwidth (5x slower than int4 on a Zen 5), while on AMX bf16 trees are nearly free. So ``auto`` measures.
Each path the engine has — ``int4`` and ``int8`` on splitspec's kernels (fp32 activations), ``bf16`` and
``fp32`` on torch — is timed on the served model's own shapes (random weights: a matmul's speed does not
depend on its values) at one token and at tree sizes, after a cached prefix. A GGUF's ``int4`` path is timed on its
own layers as the load packs them (``Own``): its kinds are its formats' kernels (Q4_K_M keeps half its down
projections and its head in Q6_K, whose kernel is slower than a 4-bit one), and a drafter's load packs them
otherwise than a target's. Enough layers are built to overflow the caches; the whole model's cost is extrapolated
from them (layers scale with their count, the head with its rows). Seconds to half a minute, once (a path already
slower than fp32 is dropped after one forward): the paths table is cached per CPU, torch version, thread count, kernel
build and model shape in the model cache's ``calibration/`` folder, beside the kernel builds' timings.

One path serves a model on a machine, whatever runs it: plain decoding, every drafter, the server (its verification
and its own decoding), the edge and the offline bridge. Each path is exact relative to itself (a tree verified in
one forward equals the same tokens decoded one by one), but two paths are two models: a drafter or a server that
ran on another path than plain decoding would change the answer. So the path is chosen once, by its cost over the
work a served model does (``MIX``: one token, a small tree, a full one), never per job; which paths may be chosen
at all (the file's own values first) is ``shared.engine.models.served_paths``. ``splitspec kernels`` prints the table.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from shared.engine import kernels
from shared.engine.decoder import DTYPES, Part, Transformer, prepare
from shared.engine.files import cache_dir
from shared.engine.layers import Rotary

# path -> (dtype, weights) as load_target takes them
# (timed in this order: fp32 before bf16, since fp32 may serve wherever any path may — ``drop_above``)
PATHS: dict[str, tuple[str, str]] = {
    "int4": ("float32", "int4"),
    "int8": ("float32", "int8"),
    "fp32": ("float32", "native"),
    "bf16": ("bfloat16", "native"),
}
SIZES = (1, 5, 17)  # tokens a timed forward verifies: plain decoding, a small tree, a full one
MIX = (1, 5, 17)  # the forwards whose summed cost the served path minimises: one token, a small tree, a full one
DRAFT_MIX = (1, 5)  # a model drafting: its steps of a few rows, and the catch-up of a round's accepted tokens
PREFIX = 128  # cached tokens every timed forward attends to
SPILL_BYTES = 96 << 20  # built layers (and head rows) hold at least this much weight: past any L3 cache
REPEATS = 5
DROPPED = "one forward cost more than fp32's whole mix; not timed further"
CLOSE = 1.2  # paths within this factor of each other are timed twice (``close_calls``)
STALL = 1.5  # a forward of fewer tokens this much slower than one of more: timed on a busy machine (``stalled``)
RETIMES = 2  # at most this many more timings of a stalled path
VERSION = 5  # bump when what is measured changes: old tables are then measured anew


@dataclasses.dataclass(frozen=True)
class Own:
    """A GGUF model whose own layers the ``int4`` path is timed on, and the ``weights`` its load takes them as:
    ``lowbit`` served (4-bit blocks and Q6_K as they are), ``int4`` drafting (the rest rounded to Q4_1)."""

    folder: Path
    weights: str

    def key(self) -> list[str]:
        return [Path(self.folder).name, self.weights]  # (a GGUF's folder is named by its file's name, size and time)


@dataclasses.dataclass
class Table:
    """Milliseconds of one forward of the whole model (blocks and LM head) per path and size; what was chosen."""

    ms: dict[str, dict[int, float]]
    cpu: str
    isa: str | None
    threads: int
    measured: str
    dropped: dict[str, float] = dataclasses.field(default_factory=dict)  # path -> ms its mix surely exceeds

    def cost(self, path: str, mix: tuple[int, ...] = MIX) -> float:
        """ms of a work mix on ``path``: one forward of each size in ``mix``."""
        return sum(self.ms[path][n] for n in mix)

    def choose(self, allowed: list[str] | None = None, mix: tuple[int, ...] = MIX) -> str:
        """The path with the cheapest work ``mix`` among ``allowed`` (default: every path measured). A drafter's
        is ``DRAFT_MIX``: it never verifies a tree, so a 17-row forward's cost must not choose its path."""
        candidates = [p for p in (allowed or self.ms) if p in self.ms]
        if not candidates:
            raise ValueError(f"none of the paths {allowed} was measured; measured: {', '.join(self.ms)}")
        return min(candidates, key=lambda p: self.cost(p, mix))

    def costs(self, path: str) -> tuple[float, float]:
        """(seconds a forward on ``path`` costs whatever it carries, seconds each token adds): the line through the
        small and the full tree's forwards, so that n tokens cost ``fixed + n · per_token``. Before a server has
        timed its own forwards this is what its trees cost: a CPU's low-bit forward grows ~0.4 of a step a token
        (AMD Zen 4), a GPU's or AMX's hardly at all, and a client sizes its first trees by it."""
        ms = self.ms[path]
        small, full = SIZES[-2], SIZES[-1]
        per_token = max(0.0, (ms[full] - ms[small]) / (full - small))
        return max(0.0, ms[1] - per_token) / 1000, per_token / 1000

    def line(self, chosen: str, why: str = "", mix: tuple[int, ...] = MIX) -> str:
        """The start-up line: the choice, why only some paths were candidates, and the figures behind it."""
        cost = lambda p: self.cost(p, mix)  # noqa: E731
        figures = ", ".join([f"{p} {cost(p):.1f}" for p in sorted(self.ms, key=cost)]
                            + [f"{p} > {ms:.0f}" for p, ms in self.dropped.items() if mix == MIX])  # fmt: skip
        mix = " + ".join(str(n) for n in mix)
        return (f"splitspec: serving path {chosen}{f' ({why})' if why else ''}; ms of a {mix}-token mix on "
                f"{self.cpu} ({self.threads} threads): {figures} (`splitspec kernels` for the table)")  # fmt: skip

    def markdown(self) -> str:
        head = "| path | " + " | ".join(f"{n} token{'s' * (n > 1)} ms" for n in SIZES)
        head += " | " + " | ".join(f"{n} / 1" for n in SIZES[1:]) + f" | mix ({' + '.join(map(str, MIX))}) ms |"
        rows = [head, "|---" * (2 * len(SIZES) + 1) + "|"]
        for p in sorted(self.ms, key=self.cost):
            ms = self.ms[p]
            ratios = " | ".join(f"{ms[n] / ms[1]:.2f}x" for n in SIZES[1:])
            rows.append(f"| {p} | " + " | ".join(f"{ms[n]:.2f}" for n in SIZES) + f" | {ratios} | {self.cost(p):.2f} |")
        for p, ms in self.dropped.items():
            rows.append(f"| {p} | " + "– | " * (2 * len(SIZES) - 1) + f"> {ms:.2f} ({DROPPED}) |")
        return "\n".join(rows)

    def to_json(self) -> dict:
        return {"version": VERSION, "ms": {p: {str(n): v for n, v in d.items()} for p, d in self.ms.items()},
                "cpu": self.cpu, "isa": self.isa, "threads": self.threads, "measured": self.measured,
                "dropped": self.dropped}  # fmt: skip

    @classmethod
    def from_json(cls, d: dict) -> Table:
        if d.get("version") != VERSION:
            raise ValueError(f"paths table version {d.get('version')}, expected {VERSION}")
        ms = {p: {int(n): float(v) for n, v in sizes.items()} for p, sizes in d["ms"].items()}
        dropped = {p: float(v) for p, v in d.get("dropped", {}).items()}
        return cls(ms, d["cpu"], d["isa"], int(d["threads"]), d["measured"], dropped)


def runnable_paths() -> list[str]:
    """The paths this machine has: the low-bit ones need the kernels."""
    return list(PATHS) if kernels.available() else ["bf16", "fp32"]


def _key(cfg, own: Own | None = None) -> str:
    blob = json.dumps([VERSION, kernels.cpu_name(), sorted(kernels.cpu_flags()), torch.__version__,
                       torch.get_num_threads(), kernels.active(), kernels.source_digest(),
                       dataclasses.asdict(cfg), SIZES, PREFIX] + ([] if own is None else own.key()))  # fmt: skip
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _layer_params(cfg) -> int:
    E, d, F = cfg.hidden_size, cfg.head_dim, cfg.mlp_hidden
    return E * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * E + 3 * E * F


BYTES_PER_PARAM = {"int4": 0.5625, "int8": 1.0, "bf16": 2.0, "fp32": 4.0}


def _model(cfg, path: str, layers: int, rows: int, own: Own | None = None):
    """A ``Transformer`` of ``cfg``'s shapes with ``layers`` blocks and ``rows`` vocabulary rows, random weights (a
    block of normal values repeated), made ready for ``path`` exactly as ``shared.engine.decoder.load_engine`` makes
    a checkpoint; on ``int4``, ``own``'s layers (``gguf.sample_layers``) and head rows in place of random ones."""
    # tied: one random [rows, hidden] table for the embeddings and the head (the timed forward reads the head's rows
    # either way), not two — the first load of a 1.5B model peaked at 2.8 GB here with both
    small = dataclasses.replace(cfg, num_layers=layers, vocab_size=rows, max_positions=PREFIX + max(SIZES) + 1,
                                tie_embeddings=True)  # fmt: skip
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float) / cfg.head_dim))
    rotary = Rotary(inv_freq, 1.0, small.max_positions)
    with torch.device("meta"):  # no initialisation: torch's random init of a slice took 2-3 s of its 5-7 on AVX2
        model = Transformer(small, rotary)
    model.to_empty(device="cpu")
    model.lm_head.weight = model.embed_tokens.weight  # (to_empty unties them)
    fill = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0)) * 0.05  # a block of values, repeated
    with torch.no_grad():
        for param in model.parameters():
            flat = param.view(-1)
            for i in range(0, flat.numel(), fill.numel()):
                flat[i : i + fill.numel()] = fill[: flat.numel() - i]
    if own is not None and path == "int4":
        _put_own(model, cfg, own, layers, rows)
    dtype, weights = PATHS[path]
    return prepare(model, DTYPES[dtype], "cpu", exact=True, weights=weights)


def _put_own(model, cfg, own: Own, layers: int, rows: int) -> None:
    """``own``'s layers and head rows into a slice ``_model`` built: what ``load_engine`` packs from them."""
    from shared.engine import gguf
    from shared.engine.decoder import assign_packed

    ckpt = gguf.Checkpoint(gguf.source_of(own.folder))
    kinds = [ckpt.layer_kinds(i) for i in range(cfg.num_layers)]
    state = {}
    for j, i in enumerate(gguf.sample_layers(kinds, layers)):  # the file's layer i as the slice's layer j
        state.update(gguf.layer_state(ckpt, cfg, i, own.weights, name=j))
    assign_packed(model, state)  # (takes the packed tensors out of ``state``)
    model.load_state_dict(state, strict=False)  # the norms and biases
    if not cfg.tie_embeddings:
        head = model.lm_head
        head.qweight, head.qscale = gguf.head_rows(ckpt, "output.weight", own.weights, rows)
        head.kernel_build, head.weight = kernels.active(), None


def _slice(cfg, path: str, own: Own | None = None):
    """(a slice of the model built for ``path``, its layers, its vocabulary rows): enough to overflow the caches."""
    per_layer = _layer_params(cfg) * BYTES_PER_PARAM[path]
    layers = max(1, min(cfg.num_layers, math.ceil(SPILL_BYTES / per_layer)))
    head_bytes = {"int4": 1.0, "int8": 1.0}.get(path, BYTES_PER_PARAM[path])  # the head stays int8 when low-bit
    rows = max(1, min(cfg.vocab_size, math.ceil(SPILL_BYTES / (head_bytes * cfg.hidden_size))))
    if own is not None and path == "int4":
        rows = max(16, rows // 16 * 16)  # a packed head's tiles are 16 rows
    return _model(cfg, path, layers, rows, own), layers, rows


def _time_path(cfg, path: str, clock: Callable[[], float], repeats: int, slices: dict | None = None,
               drop_above: float = math.inf, own: Own | None = None) -> dict[int, float] | None:  # fmt: skip
    """ms of the whole model's forward per size for one path, extrapolated from a slice of it (built once, kept in
    ``slices`` where given). None, after one timed forward, where that forward alone cost more than ``drop_above``
    ms: the path cannot be chosen, and timing it through would cost seconds (bf16 on AVX2: ~15 s for a 0.5B)."""
    slices = {} if slices is None else slices
    if path not in slices:
        slices[path] = _slice(cfg, path, own)
    model, layers, rows = slices[path]
    whole = lambda blocks, head: 1e3 * (blocks * cfg.num_layers / layers + head * cfg.vocab_size / rows)  # noqa: E731
    cache = model.new_cache(PREFIX + max(SIZES))
    timed: dict[int, tuple[list[float], list[float]]] = {n: ([], []) for n in SIZES}  # blocks, head

    def forward(n: int, keep: bool = True) -> float:
        """One forward of n tokens and its head, as a target's step runs it (``forward_many``: the blocks in one
        kernel call where they are low-bit); their times kept (unless a warm-up); the whole model's ms."""
        t0 = clock()
        h = model.forward_many([Part([0] * n, list(range(PREFIX, PREFIX + n)), None, cache, PREFIX)])[0]
        t1 = clock()
        model.logits(h)
        t2 = clock()
        if keep:
            timed[n][0].append(t1 - t0)
            timed[n][1].append(t2 - t1)
        return whole(t1 - t0, t2 - t1)

    # Each size warmed up and timed once, the drop checked on that; then the other repeats a round of every size at a
    # time, so that a host whose speed drifts shifts every size alike and the ratios between them hold.
    with torch.inference_mode():
        for n in SIZES:
            forward(n, keep=False)
            if forward(n) > drop_above:
                return None
        for _ in range(repeats - 1):
            for n in SIZES:
                forward(n)
    med = lambda s: sorted(s)[len(s) // 2]  # noqa: E731
    return {n: whole(med(blocks), med(head)) for n, (blocks, head) in timed.items()}


def measure(cfg, paths: list[str] | None = None, clock: Callable[[], float] = time.perf_counter,
            repeats: int = REPEATS, progress=None, own: Own | None = None) -> Table:  # fmt: skip
    """Time every path (default: every one this machine has, in ``PATHS``' order) on ``cfg``'s shapes (``int4`` on
    ``own``'s layers where given). A path whose one timed forward already costs more than fp32's whole mix is
    dropped: fp32 may serve wherever any path may (``shared.engine.models.served_paths``), so such a path is never
    chosen. The slices of the two cheapest paths so
    far are kept for the close call's second timing."""
    table = Table({}, kernels.cpu_label(), kernels.active() if kernels.available() else None,
                  torch.get_num_threads(), time.strftime("%Y-%m-%dT%H:%M:%S"))  # fmt: skip
    ms, slices = table.ms, {}
    for path in paths or runnable_paths():
        if progress:
            progress(path)
        bound = table.cost("fp32") if "fp32" in ms else math.inf
        timed = _time_path(cfg, path, clock, repeats, slices, drop_above=bound, own=own)
        if timed is None:
            table.dropped[path] = bound
        else:
            ms[path] = timed
        for other in sorted(ms, key=table.cost)[2:] + list(table.dropped):
            slices.pop(other, None)
    for path in [p for p in ms if stalled(ms[p])]:  # timed again, the faster timing of each size kept
        for _ in range(RETIMES):
            again = _time_path(cfg, path, clock, repeats, slices, own=own)
            ms[path] = {n: min(ms[path][n], again[n]) for n in ms[path]}
            if not stalled(ms[path]):
                break
    for path in reversed(close_calls(table)):  # timed again, in the other order, and the faster timing kept
        again = _time_path(cfg, path, clock, repeats, slices, own=own)
        ms[path] = {n: min(ms[path][n], again[n]) for n in ms[path]}
    return table


def stalled(ms: dict[int, float]) -> bool:
    """Does a forward of fewer tokens cost ``STALL`` times one of more? More tokens never read fewer weights, so
    such a timing caught the machine busy; and a table is kept for good, and prices trees and a server's cuts."""
    sizes = sorted(ms)
    return any(ms[a] > STALL * ms[b] for i, a in enumerate(sizes) for b in sizes[i + 1 :])


def close_calls(table: Table, margin: float = CLOSE) -> list[str]:
    """The paths that come first and second within ``margin`` of each other, in the order measured: a busy
    machine slows one path's few seconds of timing and can flip such a choice (on a shared 2-vCPU VM the 0.5B's
    int4 once measured 12.2 ms a token against int8's 11.5, where int4 is 0.71x int8 timed side by side), and a
    table is kept for good, so they are timed again. By a target's mix or a drafter's: either choice may be close."""
    close = set()
    for mix in (MIX, DRAFT_MIX):
        first, *rest = sorted(table.ms, key=lambda p: table.cost(p, mix))
        if rest and table.cost(rest[0], mix) < margin * table.cost(first, mix):
            close |= {first, rest[0]}
    return [p for p in table.ms if p in close]


def cache_file(cfg, cache: str | Path | None = None, own: Own | None = None) -> Path:
    return cache_dir(cache) / "calibration" / f"paths-{_key(cfg, own)}.json"


def cached(cfg, cache: str | Path | None = None, own: Own | None = None) -> Table | None:
    """The table measured for ``cfg`` (and ``own``) on this machine, None where there is none (or a half-written
    one)."""
    try:
        return Table.from_json(json.loads(cache_file(cfg, cache, own).read_text()))
    except (OSError, ValueError, KeyError):
        return None


def served_costs(cfg, dtype: str, weights: str, cache: str | Path | None = None,
                 own: Own | None = None) -> tuple[float, float] | None:  # fmt: skip
    """``Table.costs`` of the path that (``dtype``, ``weights``) name (``lowbit``: int4's), from this machine's table
    for ``cfg`` where one was measured (never measured here: a pinned path's load stays as quick as it was)."""
    pair = (dtype, "int4" if weights == "lowbit" else weights)
    name = next((p for p, served in PATHS.items() if served == pair), None)
    table = cached(cfg, cache, own)
    return table.costs(name) if table is not None and name in table.ms else None


def table_for(cfg, cache: str | Path | None = None, refresh: bool = False, own: Own | None = None) -> Table:
    """The cached table for ``cfg`` (and ``own``) on this machine, measured (and saved) when there is none."""
    path = cache_file(cfg, cache, own)
    if not refresh and (table := cached(cfg, cache, own)) is not None:
        return table
    print(f"splitspec: timing this CPU's paths on the model's shapes (once per machine and model): {path}",
          file=sys.stderr, flush=True)  # fmt: skip
    started = time.monotonic()

    def progress(name: str) -> None:  # on a terminal, one line that follows the paths (~30 s for a 0.5B on AVX2)
        if sys.stderr.isatty():
            print(f"\rsplitspec: timing {name} ({time.monotonic() - started:.0f} s)  ", end="", file=sys.stderr,
                  flush=True)  # fmt: skip

    table = measure(cfg, progress=progress, own=own)
    if sys.stderr.isatty():
        print(f"\rsplitspec: paths timed in {time.monotonic() - started:.0f} s\033[K", file=sys.stderr, flush=True)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(table.to_json(), indent=1))
    except OSError:
        pass  # a read-only cache: measured again next time
    return table
