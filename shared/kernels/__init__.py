"""splitspec's compiled CPU kernels (``cpu.cpp``): int8 linear layers and a fixed-order attention.

They are built from source on the machine that runs them, once per CPU kind and torch version, with
the instruction sets that CPU reports (AVX2+FMA where present, a portable build elsewhere; never
``-march=native``, which some VMs advertise wrongly). ``make setup`` builds them; otherwise the first
use does (~1 min). The ops land in ``torch.ops.splitspec``; ``available()`` says whether they could
be built here and ``unavailable_reason()`` why not.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
from functools import cache
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu.cpp")
# -fopenmp: at::parallel_for is OpenMP in torch's headers (the same libgomp torch loaded); -ffp-contract=off: no
# fused multiply-adds the source did not write, so float results are what the source says
CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]


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


def cpu_label() -> str:
    """The CPU's model and the vector ISAs that decide which path is fast on it, e.g. ``AMD EPYC (AVX2)``: what
    every measurement is labelled with, since the machines this project runs on alternate."""
    flags = cpu_flags()
    isas = [name for name, flag in (("AVX2", "avx2"), ("AVX-512", "avx512f"), ("AVX512-BF16", "avx512_bf16"),
                                    ("AVX512-VNNI", "avx512_vnni"), ("AMX", "amx_bf16")) if flag in flags]  # fmt: skip
    return f"{cpu_name()} ({', '.join(isas) or 'no AVX2'})"


def isa_flags() -> tuple[str, list[str]]:
    """(tag, compiler flags) for the widest instruction set the kernels have a path for on this CPU."""
    flags = cpu_flags()
    if platform.machine() in ("x86_64", "AMD64") and {"avx2", "fma", "f16c"} <= flags:
        return "avx2", ["-mavx2", "-mfma", "-mf16c"]
    return "portable", []


def build_directory() -> Path:
    """Beside the source when that is writable (a checkout: every process finds the build whatever its model
    cache), else in the user's cache; one folder per ISA, flags, source and torch version."""
    tag, flags = isa_flags()
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS + flags).encode()).hexdigest()[:12]
    version = torch.__version__.replace("+", "_")
    root = SOURCE.parent / "build" if os.access(SOURCE.parent, os.W_OK) else Path.home() / ".cache" / "splitspec"
    return root / f"{tag}-torch{version}-{digest}"


@cache
def _load() -> str | None:
    """Build (if needed) and load the kernels; None on success, else why they are not here."""
    if os.environ.get("SPLITSPEC_KERNELS", "").lower() in ("0", "off", "no"):
        return "turned off by SPLITSPEC_KERNELS"
    try:
        from torch.utils.cpp_extension import load
    except ImportError as e:  # pragma: no cover - every torch wheel has it
        return f"torch has no extension builder: {e}"
    try:  # torch's builder runs `ninja` from PATH: the ninja package's binary, where a venv is not on PATH
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except (ImportError, AttributeError):
        pass
    tag, flags = isa_flags()
    out = build_directory()
    out.mkdir(parents=True, exist_ok=True)
    built = any(out.glob("*.so"))
    if not built:
        print(f"splitspec: building the CPU kernels for {tag} in {out} (once, ~1 min)", file=sys.stderr)
    try:
        load(name=f"splitspec_cpu_{tag}", sources=[str(SOURCE)], build_directory=str(out),
             extra_cflags=[*CFLAGS, *flags], extra_ldflags=["-fopenmp"],
             is_python_module=False, verbose=False)  # fmt: skip
    except Exception as e:  # a compiler or header missing: the engine says so and serves without them
        return f"building {SOURCE.name} failed: {str(e).strip().splitlines()[-1] if str(e).strip() else e!r}"
    return None


def available() -> bool:
    """Whether the kernels are built and loaded here (building them on first call)."""
    return _load() is None


def unavailable_reason() -> str | None:
    return _load()


def isa() -> str:
    """What the loaded kernels compute with: ``avx2`` or ``portable``."""
    if not available():
        raise RuntimeError(f"the CPU kernels are not available: {unavailable_reason()}")
    return torch.ops.splitspec.isa()


def main() -> None:
    """``python -m shared.kernels``: build now (``make setup``) and say what was built."""
    if not available():
        sys.exit(f"splitspec: {unavailable_reason()}")
    print(f"splitspec kernels: {isa()} on {cpu_name()} ({build_directory()})")


if __name__ == "__main__":
    main()
