"""shared.engine.parts: files cut into parts here, received a part a call and joined there, checked end to end."""

from __future__ import annotations

import os

import pytest

from shared.engine import parts
from shared.errors import SplitspecError

MIB = 1 << 20


@pytest.fixture
def machines(tmp_path, monkeypatch):
    """This machine's working tree and cache, and the GPU machine's, as folders; a model file and a bundle to send."""
    here, there = tmp_path / "here", tmp_path / "there"
    for side in (here, there):
        (side / "repo").mkdir(parents=True)
    monkeypatch.setenv("SPLITSPEC_CACHE", str(here / "cache"))
    model = here / "cache" / "models" / "m.gguf"
    bundle = here / "repo" / "client" / "bundle" / "weights.safetensors"
    for path, size in ((model, 3 * MIB + 12345), (bundle, MIB // 3)):
        path.parent.mkdir(parents=True)
        path.write_bytes(os.urandom(size))
    return here, there, model, bundle


def test_files_cut_into_parts_come_back_whole_where_they_belong(machines, monkeypatch):
    here, there, model, bundle = machines
    folder = here / "repo" / ".gpu" / "parts"
    manifest = parts.pack([model, bundle], folder, MIB, root=here / "repo")
    assert [e["dest"] for e in manifest["files"]] == ["cache:models/m.gguf", "repo:client/bundle/weights.safetensors"]
    names = [p["file"] for e in manifest["files"] for p in e["parts"]]
    assert len(names) == 5 and all((folder / n).stat().st_size <= MIB for n in names)
    assert parts.calls(folder, MIB) == [[n] for n in names[:3]] + [names[3:]]  # the small tail and the bundle share

    monkeypatch.setenv("SPLITSPEC_CACHE", str(there / "cache"))  # now on the GPU machine
    store = there / "store"
    for name in names[:-1]:  # a call a part: each call's tree holds its part and the manifest
        call = there / f"call-{name}"
        call.mkdir()
        (call / name).write_bytes((folder / name).read_bytes())
        (call / parts.MANIFEST).write_bytes((folder / parts.MANIFEST).read_bytes())
        assert parts.receive([call / name], store) == [name]
    done, missing = parts.join(store, root=there / "repo")
    assert missing == [names[-1]] and done == [there / "cache" / "models" / "m.gguf"]
    assert done[0].read_bytes() == model.read_bytes()

    call = there / "last"
    call.mkdir()
    (call / parts.MANIFEST).write_bytes((folder / parts.MANIFEST).read_bytes())
    (call / names[-1]).write_bytes(b"x" + (folder / names[-1]).read_bytes()[1:])  # broken on the way
    with pytest.raises(SplitspecError, match="broke on the way"):
        parts.receive([call / names[-1]], store)
    (call / names[-1]).write_bytes((folder / names[-1]).read_bytes())
    parts.receive([call / names[-1]], store)
    done, missing = parts.join(store, root=there / "repo")
    assert not missing and (there / "repo" / "client" / "bundle" / "weights.safetensors").read_bytes() == \
        bundle.read_bytes()  # fmt: skip
    assert parts.join(store, root=there / "repo") == (done, [])  # whole already: left as it is


def test_a_store_whose_parts_do_not_add_up_is_refused_and_nothing_half_written_stays(machines, monkeypatch):
    here, there, model, _ = machines
    folder = here / "parts"
    names = [p["file"] for p in parts.pack([model], folder, MIB, root=here / "repo")["files"][0]["parts"]]
    monkeypatch.setenv("SPLITSPEC_CACHE", str(there / "cache"))
    store = there / "store"
    parts.receive([folder / n for n in names], store)
    (store / names[1]).write_bytes(os.urandom(MIB))  # changed after it was received
    with pytest.raises(SplitspecError, match="SHA-256 is not the manifest's"):
        parts.join(store)
    assert not any((there / "cache" / "models").iterdir())


def test_what_cannot_be_packed_is_named(machines, tmp_path):
    here, _, model, _ = machines
    with pytest.raises(SplitspecError, match="no such file"):
        parts.pack([here / "absent.gguf"], tmp_path / "p", MIB)
    with pytest.raises(SplitspecError, match="neither in the working tree"):
        outside = tmp_path / "elsewhere.bin"
        outside.write_bytes(b"1")
        parts.pack([outside], tmp_path / "p", MIB, root=here / "repo")
    with pytest.raises(SplitspecError, match="at least 1 MiB"):
        parts.pack([model], tmp_path / "p", 1000)
    assert parts.main(["join", "--store", str(tmp_path / "nothing")]) == 2
