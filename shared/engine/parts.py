"""Files too big for one call to a lent GPU machine, cut into parts here and joined there.

A lent machine is reached only through calls that carry the working tree, 64 MiB a call, and it keeps its disk
only while it stays warm between calls. So the pair's GGUFs and drafter bundles go over a part a call: ``pack`` cuts
them here and writes a manifest (each whole file's and each part's size and SHA-256, and where the file belongs),
``receive`` (there, one call a part) checks a part and moves it into a store that outlives the call, and ``join``
(there) puts each whole file where splitspec looks for it, checked against its SHA-256. docs/serving.md gives the
order of the calls.

Run:  python -m shared.engine.parts pack FILE... [--out .gpu/parts] [--part-mib 60]
      python -m shared.engine.parts calls [--out .gpu/parts] [--mib 61]   # the parts each call carries, a line a call
      python -m shared.engine.parts receive PART... [--store DIR]
      python -m shared.engine.parts join [--store DIR]
Standard library only: it runs on the GPU machine before anything else is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

from shared.engine.files import cache_dir
from shared.errors import SplitspecError

MANIFEST = "manifest.json"
DEFAULT_PARTS = Path(".gpu/parts")
DEFAULT_STORE = Path("/tmp/splitspec-parts")
CACHE, REPO = "cache:", "repo:"  # where a joined file goes: under splitspec's cache, or the working tree


def sha256(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def destination(path: Path, root: Path | None = None) -> str:
    """Where ``path`` belongs on the other machine: ``repo:<path in the working tree>`` for a file inside it (a
    drafter bundle), else ``cache:<path under splitspec's cache>`` (a model file)."""
    path, root, cache = path.resolve(), (root or Path.cwd()).resolve(), cache_dir().resolve()
    if path.is_relative_to(root):
        return REPO + path.relative_to(root).as_posix()
    if path.is_relative_to(cache):
        return CACHE + path.relative_to(cache).as_posix()
    raise SplitspecError(f"{path}: neither in the working tree ({root}) nor in splitspec's cache ({cache}); "
                         "expected a model file or a drafter bundle")  # fmt: skip


def resolve(dest: str, root: Path | None = None) -> Path:
    """The path a manifest's ``dest`` names on this machine."""
    if dest.startswith(REPO):
        return (root or Path.cwd()) / dest.removeprefix(REPO)
    if dest.startswith(CACHE):
        return cache_dir() / dest.removeprefix(CACHE)
    raise SplitspecError(f"a manifest entry goes to {dest!r}; expected {REPO}... or {CACHE}...")


def pack(files: list[Path], out: Path, part_bytes: int, root: Path | None = None) -> dict:
    """Cut ``files`` into parts of at most ``part_bytes`` under ``out`` and write its manifest; returns it. Parts
    already there with the right hash are kept, so packing again after a change costs only the changed files."""
    if part_bytes < 1 << 20:
        raise SplitspecError(f"parts of {part_bytes} bytes; expected at least 1 MiB")
    out.mkdir(parents=True, exist_ok=True)
    entries = []
    for i, path in enumerate(files):
        if not path.is_file():
            raise SplitspecError(f"{path}: no such file to pack")
        size, parts = path.stat().st_size, []
        with path.open("rb") as f:
            for j in range(max(1, -(-size // part_bytes))):
                name = f"{i:02d}-{path.name}.part{j:03d}"
                data = f.read(part_bytes)
                digest = hashlib.sha256(data).hexdigest()
                target = out / name
                if not (target.is_file() and target.stat().st_size == len(data) and sha256(target) == digest):
                    target.write_bytes(data)
                parts.append({"file": name, "size": len(data), "sha256": digest})
        entries.append({"dest": destination(path, root), "size": size, "sha256": sha256(path), "parts": parts})
        print(f"splitspec parts: {path.name}: {len(parts)} part(s) of <= {part_bytes >> 20} MiB", file=sys.stderr)
    manifest = {"files": entries}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def _manifest(folder: Path) -> dict:
    try:
        return json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise SplitspecError(f"no readable {MANIFEST} in {folder}: {e}") from None


def receive(parts: list[Path], store: Path) -> list[str]:
    """Check each part against the manifest beside it and move it into ``store`` (with the manifest); returns the
    names kept. A part whose hash differs is refused: it broke in transit."""
    store.mkdir(parents=True, exist_ok=True)
    kept = []
    for part in parts:
        manifest = _manifest(part.parent)
        known = {p["file"]: p for e in manifest["files"] for p in e["parts"]}
        if part.name not in known:
            raise SplitspecError(f"{part.name}: not a part the manifest in {part.parent} lists")
        if sha256(part) != known[part.name]["sha256"]:
            raise SplitspecError(f"{part.name}: its SHA-256 is not the manifest's: it broke on the way; send it again")
        shutil.copyfile(part.parent / MANIFEST, store / MANIFEST)
        shutil.move(str(part), store / part.name)
        kept.append(part.name)
    return kept


def join(store: Path, root: Path | None = None) -> tuple[list[Path], list[str]]:
    """Every file of the store's manifest whose parts are all there, joined where it belongs and checked against its
    SHA-256 (a file already there and whole is left as it is); returns (the files in place, the parts missing)."""
    manifest = _manifest(store)
    done, missing = [], []
    for entry in manifest["files"]:
        target = resolve(entry["dest"], root)
        if target.is_file() and target.stat().st_size == entry["size"] and sha256(target) == entry["sha256"]:
            done.append(target)
            continue
        absent = [p["file"] for p in entry["parts"] if not (store / p["file"]).is_file()]
        if absent:
            missing += absent
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".joining")
        with partial.open("wb") as out:
            for p in entry["parts"]:
                with (store / p["file"]).open("rb") as f:
                    shutil.copyfileobj(f, out)
        if sha256(partial) != entry["sha256"]:
            partial.unlink()
            raise SplitspecError(f"{target.name}: the joined parts' SHA-256 is not the manifest's; expected "
                                 f"{entry['sha256']}")  # fmt: skip
        os.replace(partial, target)
        done.append(target)
    return done, missing


def calls(folder: Path, budget: int) -> list[list[str]]:
    """The manifest's parts grouped into calls of at most ``budget`` bytes each, in order (small files share one)."""
    groups: list[list[str]] = []
    size = budget
    for part in (p for e in _manifest(folder)["files"] for p in e["parts"]):
        if size + part["size"] > budget:
            groups.append([])
            size = 0
        groups[-1].append(part["file"])
        size += part["size"]
    return groups


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shared.engine.parts", description=__doc__.split("\n\n")[0])
    verbs = p.add_subparsers(dest="verb", required=True)
    pk = verbs.add_parser("pack", help="cut files into parts and write their manifest (here)")
    pk.add_argument("files", nargs="+", type=Path)
    pk.add_argument("--out", type=Path, default=DEFAULT_PARTS, help=f"the parts' folder (default {DEFAULT_PARTS})")
    pk.add_argument("--part-mib", type=int, default=60, help="MiB a part at most (default 60: a call carries 64 "
                    "MiB with the working tree)")  # fmt: skip
    cl = verbs.add_parser("calls", help="the parts each call carries, a line a call (here)")
    cl.add_argument("--out", type=Path, default=DEFAULT_PARTS)
    cl.add_argument("--mib", type=int, default=61, help="MiB a call carries besides the working tree (default 61)")
    rc = verbs.add_parser("receive", help="check parts and move them into the store (on the GPU machine)")
    rc.add_argument("parts", nargs="+", type=Path)
    rc.add_argument("--store", type=Path, default=DEFAULT_STORE, help=f"kept between calls (default {DEFAULT_STORE})")
    jn = verbs.add_parser("join", help="join the stored parts into whole files where they belong (there)")
    jn.add_argument("--store", type=Path, default=DEFAULT_STORE)
    args = p.parse_args(argv)
    try:
        if args.verb == "pack":
            manifest = pack(args.files, args.out, args.part_mib << 20)
            names = [q["file"] for e in manifest["files"] for q in e["parts"]]
            print(f"splitspec parts: {len(names)} parts and {MANIFEST} in {args.out}")
        elif args.verb == "calls":
            for group in calls(args.out, args.mib << 20):
                print(" ".join(str(args.out / name) for name in group))
        elif args.verb == "receive":
            print(f"splitspec parts: kept {', '.join(receive(args.parts, args.store))} in {args.store}")
        else:
            done, missing = join(args.store)
            for path in done:
                print(f"splitspec parts: {path} (SHA-256 checked)")
            if missing:
                print(f"splitspec parts: {len(missing)} part(s) not received yet: {', '.join(missing)}",
                      file=sys.stderr)  # fmt: skip
                return 1
    except SplitspecError as e:
        print(f"splitspec parts: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
