"""splitspec's compiled CPU kernels (``cpu.cpp``): low-bit linear layers and a fixed-order attention.

One source, several builds, each for an instruction set: ``amx`` (the ``avx512-vnni`` build whose int8 sums of a
forward of several rows run on AMX tiles, ``tdpbssd``; Sapphire Rapids and later Xeons), ``avx512-vnni`` (512-bit
``vpdpbusd`` for the integer dot products; Zen 4/5, Ice Lake and later Xeons), ``avx-vnni`` (the AVX2 kernels with
256-bit ``vpdpbusd``; Alder Lake and later client CPUs, Zen 5), ``avx2`` (AVX2+FMA+F16C), ``portable`` (plain C++).
They are built from source on the machine that runs them, once per CPU kind and torch version, never with
``-march=native`` (some VMs advertise it wrongly). The vector builds compute the same bits: integer sums are exact
and the float steps are written once, in one order, so between them a build is a matter of speed only (the portable
build's norms and exp sum in plain loops: a target of its own).

Which builds *can* run here is a CPU flag question (an instruction the CPU lacks kills the process); which one
*is used* is measured: ``active()`` times the runnable builds on a typical projection and takes the fastest,
cached per CPU, torch version and source (``SPLITSPEC_ISA`` pins one). A build registers its ops as
``torch.ops.splitspec_<isa>``; ``ops()`` is the active build's, ``Blocks()`` its fused decoder stack.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from functools import cache
from pathlib import Path

import torch

from shared.engine import hugepages
from shared.engine.files import cache_dir
from shared.engine.quant import pack_int4, pack_int8

SOURCE = Path(__file__).with_name("cpu.cpp")
# -fopenmp: at::parallel_for is OpenMP in torch's headers (the same libgomp torch loaded); -ffp-contract=off: no
# fused multiply-adds the source did not write, so float results are what the source says
CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]
_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
# widest first: (the CPU flags a build needs to run at all, its compiler flags)
_AVX512_FLAGS = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512vbmi"})
_AVX512 = [*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mavx512vbmi"]
BUILDS: dict[str, tuple[frozenset[str], list[str]]] = {
    "amx": (_AVX512_FLAGS | {"amx_tile", "amx_int8"}, [*_AVX512, "-mamx-tile", "-mamx-int8"]),
    "avx512-vnni": (_AVX512_FLAGS, _AVX512),
    "avx-vnni": (frozenset({"avx2", "fma", "f16c", "avx_vnni"}), [*_AVX2, "-mavxvnni"]),
    "avx2": (frozenset({"avx2", "fma", "f16c"}), _AVX2),
    "portable": (frozenset(), []),
}  # fmt: skip


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux reports them (empty elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_name() -> str:
    """The CPU's model name, for labelling every measurement."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_isas() -> list[str]:
    """The vector ISAs that decide which path is fast on this CPU, as names a reader knows."""
    flags = cpu_flags()
    named = (("AVX2", "avx2"), ("AVX-512", "avx512f"), ("AVX512-BF16", "avx512_bf16"), ("AVX512-VNNI", "avx512_vnni"),
             ("AVX-VNNI", "avx_vnni"), ("AMX", "amx_bf16"))  # fmt: skip
    return [name for name, flag in named if flag in flags]


def cpu_label() -> str:
    """The CPU's model and its vector ISAs, e.g. ``AMD EPYC (AVX2)``: what every measurement is labelled with,
    since the machines this project runs on alternate."""
    return f"{cpu_name()} ({', '.join(cpu_isas()) or 'no AVX2'})"


def runnable() -> list[str]:
    """The builds this CPU can execute, widest first (``portable`` always)."""
    flags = cpu_flags()
    x86 = platform.machine() in ("x86_64", "AMD64")
    return [tag for tag, (needs, _) in BUILDS.items() if not needs or (x86 and needs <= flags)]


@cache
def source_digest() -> str:
    """The kernels' source, hashed: what every build folder and every timing cached for them is keyed by."""
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()


def namespace(tag: str) -> str:
    return "splitspec_" + tag.replace("-", "_")


def build_directory(tag: str) -> Path:
    """Beside the source when that is writable (a checkout: every process finds the build whatever its model
    cache), else in the user's cache; one folder per ISA, flags, source and torch version."""
    flags = BUILDS[tag][1]
    digest = hashlib.sha256((source_digest() + " ".join(CFLAGS + flags)).encode()).hexdigest()[:12]
    version = torch.__version__.replace("+", "_")
    root = SOURCE.parent / "build" if os.access(SOURCE.parent, os.W_OK) else Path.home() / ".cache" / "splitspec"
    return root / f"{tag}-torch{version}-{digest}"


def _disabled() -> str | None:
    if os.environ.get("SPLITSPEC_KERNELS", "").lower() in ("0", "off", "no"):
        return "turned off by SPLITSPEC_KERNELS"
    return None


@cache
def load(tag: str) -> str | None:
    """Build (if needed) and load one build; None on success, else why it is not here."""
    if tag not in BUILDS:
        return f"unknown kernel build {tag!r}; expected one of {', '.join(BUILDS)}"
    if reason := _disabled():
        return reason
    if tag not in runnable():
        return f"this CPU lacks {', '.join(sorted(BUILDS[tag][0] - cpu_flags()))} for the {tag} build"
    try:
        from torch.utils.cpp_extension import load as build
    except ImportError as e:  # pragma: no cover - every torch wheel has it
        return f"torch has no extension builder: {e}"
    try:  # torch's builder runs `ninja` from PATH: the ninja package's binary, where a venv is not on PATH
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except (ImportError, AttributeError):
        pass
    out = build_directory(tag)
    out.mkdir(parents=True, exist_ok=True)
    if not any(out.glob("*.so")):
        print(f"splitspec: building the CPU kernels for {tag} in {out} (once, ~1 min)", file=sys.stderr)
    try:
        build(name=namespace(tag), sources=[str(SOURCE)], build_directory=str(out),
              extra_cflags=[*CFLAGS, *BUILDS[tag][1], f"-DSPLITSPEC_NS={namespace(tag)}"],
              extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)  # fmt: skip
    except Exception as e:  # a compiler or header missing: the engine says so and serves without them
        return f"building {SOURCE.name} for {tag} failed: {str(e).strip().splitlines()[-1] if str(e).strip() else e!r}"
    if not getattr(torch.ops, namespace(tag)).ready():
        return f"the {tag} build cannot run in this process (Linux refused it the AMX tile state)"
    if out.parent == SOURCE.parent / "build":  # a checkout's own builds: those of an older source go
        for old in out.parent.glob(out.name.rsplit("-", 1)[0] + "-*"):
            if old != out:
                shutil.rmtree(old, ignore_errors=True)
    return None


def builds() -> list[str]:
    """The builds loaded here (building each runnable one on first call), widest first."""
    return [tag for tag in runnable() if load(tag) is None]


def _timing_key() -> str:
    key = f"{cpu_name()}|{sorted(cpu_flags())}|{torch.__version__}|{torch.get_num_threads()}|{source_digest()}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def time_builds(tags: list[str], repeats: int = 7, clock=time.perf_counter) -> dict[str, float]:
    """Median seconds of one int4 and one int8 projection (K 2048, N 4096) at 1 and 16 rows, per build: what a
    decode step and a tree spend most of their time in. Builds alternate, so drift hits them alike."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(4096, 2048, generator=gen) * 0.02
    q4 = pack_int4(w)
    q8 = {tag: pack_int8(w, ops(tag).int8_layout()) for tag in tags}
    xs = [torch.randn(m, 2048, generator=gen) for m in (1, 16)]
    samples: dict[str, list[float]] = {t: [] for t in tags}
    for i in range(repeats + 1):
        for tag in tags:
            linear = ops(tag).linear
            start = clock()
            for x in xs:
                linear(x, *q4, None, None)
                linear(x, *q8[tag], None, None)
            if i:  # the first round warms up
                samples[tag].append(clock() - start)
    return {t: sorted(s)[len(s) // 2] for t, s in samples.items()}


@cache
def active() -> str | None:
    """The build the engine uses: ``SPLITSPEC_ISA`` if set, else the fastest loaded build as measured here (cached
    in the model cache's ``calibration/`` per CPU, torch version, thread count and source); None when none loaded."""
    pinned = os.environ.get("SPLITSPEC_ISA")
    if pinned:
        if reason := load(pinned):
            raise RuntimeError(f"SPLITSPEC_ISA={pinned}: {reason}")
        return pinned
    loaded = builds()
    if len(loaded) <= 1:
        return loaded[0] if loaded else None
    timed = [t for t in loaded if t != "portable"] or loaded  # portable is for CPUs without AVX2: never faster
    path = cache_dir() / "calibration" / f"kernels-{_timing_key()}.json"
    try:
        record = json.loads(path.read_text())
        if set(record["seconds"]) == set(timed):
            return record["chosen"]
    except (OSError, ValueError, KeyError):
        pass
    seconds = time_builds(timed)
    chosen = min(seconds, key=seconds.get)
    record = {"cpu": cpu_label(), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "seconds": seconds, "chosen": chosen, "measured": time.strftime("%Y-%m-%dT%H:%M:%S")}  # fmt: skip
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1))
    except OSError:
        pass  # a read-only cache: measured again next time
    return chosen


@contextlib.contextmanager
def use(tag: str):
    """Within the block, ``tag`` is the active build: what a model quantised there is packed for and runs on (a
    quantised layer keeps its build), so one process can hold a model on each build and time them side by side."""
    if reason := load(tag):
        raise RuntimeError(f"kernel build {tag}: {reason}")
    before = os.environ.get("SPLITSPEC_ISA")
    os.environ["SPLITSPEC_ISA"] = tag
    active.cache_clear()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("SPLITSPEC_ISA", None)
        else:
            os.environ["SPLITSPEC_ISA"] = before
        active.cache_clear()


def available() -> bool:
    """Whether a build is loaded here (building on first call)."""
    return active() is not None


def unavailable_reason() -> str | None:
    if available():
        return None
    return "; ".join(f"{t}: {load(t)}" for t in BUILDS if load(t)) or "no build"


def ops(tag: str | None = None):
    """The ops of a build (default: the active one): ``linear``, ``norm_linear``, ``mlp``, ``attend``, ``isa``."""
    tag = tag or active()
    if tag is None or (reason := load(tag)):
        raise RuntimeError(f"the CPU kernels are not available: {unavailable_reason() if tag is None else reason}")
    return getattr(torch.ops, namespace(tag))


def Blocks(*args, tag: str | None = None):  # noqa: N802 - a class, as torch names it
    """A fused stack of low-bit decoder blocks on a build (default: the active one)."""
    ops(tag)  # loaded, or a clear error
    return getattr(torch.classes, namespace(tag or active())).Blocks(*args)


def int8_peak(tag: str | None = None, seconds: float = 0.05) -> float:
    """Int8 multiply-adds a second that a build's multiply instruction issues on torch's threads in a loop with
    nothing else in it (``cpu.cpp``'s ``int8_peak``): the ceiling to read the kernels' own rate against. The loop
    grows until a run takes ``seconds``; the best of three runs of that length."""
    op = ops(tag).int8_peak
    steps = 1 << 14
    while True:
        start = time.perf_counter()
        op(steps)
        if time.perf_counter() - start >= seconds:
            break
        steps *= 4
    return max(op(steps) for _ in range(3))


def read_peak(megabytes: int = 256, passes: int = 4) -> float:
    """Bytes a second that torch's threads read from memory, streaming a buffer of ``megabytes`` (larger than the
    caches) with nothing else to do (``cpu.cpp``'s ``read_rate``): the ceiling of plain decoding, which reads every
    weight once a token; in 2 MB pages where the weights are (``hugepages``). The best of three runs after one to
    warm up."""
    size = megabytes << 20  # (untouched here: each thread writes its share first)
    if hugepages.available():
        buffer = torch.frombuffer(hugepages.arena(size), dtype=torch.uint8)
    else:
        buffer = torch.empty(size, dtype=torch.uint8)
    op = ops().read_rate
    op(buffer, 1)
    return max(op(buffer, passes) for _ in range(3))


def isa() -> str:
    """What the active build computes with: ``amx``, ``avx512-vnni``, ``avx-vnni``, ``avx2`` or ``portable``."""
    return ops().isa()


def compile_side_by_side() -> None:
    """Compile the runnable builds not yet here at once, a process each, as many as there are CPUs: one source file
    compiles on one core, so ``make setup`` pays about a minute, not a minute per build. A build that fails here is
    tried again, and its failure told, by ``builds()``."""
    todo = [tag for tag in runnable() if not _disabled() and not any(build_directory(tag).glob("*.so"))]
    width = max(1, min(len(todo), os.cpu_count() or 1))
    for start in range(0, len(todo), width):
        children = [subprocess.Popen([sys.executable, "-c", f"from shared.engine.kernels import load; load({tag!r})"])
                    for tag in todo[start : start + width]]  # fmt: skip
        for child in children:
            child.wait()


def main() -> None:
    """``python -m shared.engine.kernels``: build every runnable ISA now (``make setup``), time them, say which is
    used."""
    compile_side_by_side()
    loaded = builds()
    if not loaded:
        sys.exit(f"splitspec: {unavailable_reason()}")
    for tag in runnable():
        print(f"splitspec kernels: {tag:12s} {'built' if tag in loaded else load(tag)} ({build_directory(tag)})")
    print(f"splitspec kernels: using {active()} on {cpu_label()}")


if __name__ == "__main__":
    main()
