"""GGUF checkpoints (llama.cpp's format) in the engine, read in place, with no fp32 copy of the model.

A GGUF file stands for a model folder: its config and tokenizer (parsed by transformers from the metadata, no
tensors read) go into a small folder in the cache with ``gguf.json`` pointing back at the file, so every path that
takes a Hugging Face folder takes a GGUF too. Its weights are read from the file a tensor (or a slice of rows) at a
time:

* 4-bit blocks (Q4_0, Q4_1, Q4_K) are served as they are on the CPU kernels' int4 path: a block's 4-bit values are
  kept and its scale and minimum become the kernel's fp16 pair, or, for Q4_K, stay its 6-bit scale and minimum
  with the fp16 d and dmin of each 256 values (4.5 bits a weight, the file's own values exactly);
* Q6_K is served as it is on the kernels' int6 path (its 6-bit values, 16-value scales and super-block d kept);
* every other kind (F32, F16, BF16, Q8_0, Q5_0, Q5_1, Q5_K, ...) is dequantised exactly to fp32 and then made
  what the path serves: int8 with a scale per row on the low-bit paths (re-quantised), or the float dtype.

A fused projection (q, k, v; gate, up) is int4 (int6) only when all its parts are 4-bit kinds (Q6_K). What a
conversion makes is cached beside the config (``weights-*.pt``), and a later load memory-maps the served bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import mmap
import os
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shared.engine import kernels
from shared.engine.quant import pack_int4, pack_int4_blocks, pack_int4k_blocks, pack_int6_blocks, pack_int8
from shared.errors import SplitspecError

POINTER = "gguf.json"
FORMAT = 6  # of the cached weights: bump when the conversion changes
EMBEDDINGS = "embeddings.npy"  # the cached low-bit weights' fp32 embeddings (memory-mapped)

# the engine's projections and the GGUF tensors they are made of (blk.N.<name>.weight / .bias)
PROJECTIONS = {
    "self_attn.qkv": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}
NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _gguf():
    try:
        import gguf
    except ImportError as exc:  # a dependency of the project: only a broken install lacks it
        raise SplitspecError("reading GGUF files needs the `gguf` package: pip install gguf") from exc
    return gguf


def is_gguf(path: str | os.PathLike) -> bool:
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"


def source_of(folder: str | os.PathLike) -> Path | None:
    """The GGUF file a cache folder stands for (None: a plain Hugging Face folder)."""
    pointer = Path(folder) / POINTER
    if not pointer.is_file():
        return None
    return Path(json.loads(pointer.read_text())["gguf"])


def folder_for(path: str | os.PathLike, cache: Path, name: str | None = None) -> Path:
    """The cache folder standing for the GGUF at ``path``: config.json, the tokenizer, ``gguf.json``. Made once per
    file (its name, size and modification time key it)."""
    path = Path(path).resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:10]
    folder = cache / "gguf" / f"{path.stem}-{key}"
    if (folder / POINTER).is_file() and (folder / "config.json").is_file():
        return folder
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        try:
            config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
            # A GGUF has no tokenizer_config.json, so AutoTokenizer takes the class registered for the config's
            # type where there is one: taken here directly, as AutoTokenizer would parse the whole header once
            # more for the config (tens of seconds for a Qwen2.5 file). Where none is (llama), AutoTokenizer.
            tokenizer = TOKENIZER_MAPPING.get(type(config), AutoTokenizer).from_pretrained(
                path.parent, gguf_file=path.name)
        except (ValueError, KeyError, OSError) as exc:
            raise SplitspecError(f"{path}: not a GGUF decoder transformers can describe ({exc!r})") from exc
        config.tie_word_embeddings = "output.weight" not in Checkpoint(path).tensors
        config.name_or_path = name or path.stem
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / POINTER).write_text(json.dumps({"gguf": str(path), "size": stat.st_size}, indent=1) + "\n")
        try:
            tmp.rename(folder)
        except OSError:  # another process made it first
            if not (folder / POINTER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


@dataclasses.dataclass(frozen=True)
class Tensor:
    """Where one tensor's bytes are in a GGUF file and how they are stored (dimensions innermost first)."""

    name: str
    shape: tuple[int, ...]
    tensor_type: Any  # a gguf.GGMLQuantizationType
    data_offset: int  # from the start of the file

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def n_bytes(self) -> int:
        block, size = _gguf().GGML_QUANT_SIZES[self.tensor_type]
        return self.n_elements // block * size


# GGUF metadata value types of a fixed width (struct format), by type id; 8 is a string, 9 an array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def read_header(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A GGUF file's scalar metadata (strings and numbers; arrays skipped) and its tensor table, by name. Walks the
    header once: gguf's own ``GGUFReader`` makes an array view of every one of a vocabulary's 150k strings (seconds
    for a Qwen2.5 file), this skips them."""
    gguf = _gguf()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob:
        if blob[:4] != b"GGUF":
            raise ValueError("no GGUF magic at the start")
        version, n_tensors, n_values = struct.unpack_from("<IQQ", blob, 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version}, expected 2 or 3")
        pos = 24

        def string() -> str:
            nonlocal pos
            (n,) = struct.unpack_from("<Q", blob, pos)
            pos += 8 + n
            return blob[pos - n : pos].decode("utf-8", errors="replace")

        def value(kind: int) -> Any:
            nonlocal pos
            if kind in _SCALARS:
                (v,) = struct.unpack_from(_SCALARS[kind], blob, pos)
                pos += struct.calcsize(_SCALARS[kind])
                return v
            if kind == 8:
                return string()
            if kind != 9:
                raise ValueError(f"metadata value type {kind} at byte {pos}, expected 0..12")
            item, count = struct.unpack_from("<IQ", blob, pos)
            pos += 12
            if item in _SCALARS:
                pos += count * struct.calcsize(_SCALARS[item])
            else:
                for _ in range(count):
                    value(item)
            return None  # arrays (a vocabulary, its merges) are not needed here

        metadata = {}
        for _ in range(n_values):
            key = string()
            (kind,) = struct.unpack_from("<I", blob, pos)
            pos += 4
            if (v := value(kind)) is not None:
                metadata[key] = v
        entries = []
        for _ in range(n_tensors):
            name = string()
            (dims,) = struct.unpack_from("<I", blob, pos)
            shape = struct.unpack_from(f"<{dims}Q", blob, pos + 4)
            kind, offset = struct.unpack_from("<IQ", blob, pos + 4 + 8 * dims)
            pos += 4 + 8 * dims + 12
            entries.append((name, shape, gguf.GGMLQuantizationType(kind), offset))
    alignment = int(metadata.get("general.alignment", 32))
    start = -(-pos // alignment) * alignment  # the tensors' data, after the header, aligned
    return metadata, {name: Tensor(name, shape, kind, start + offset) for name, shape, kind, offset in entries}


class Checkpoint:
    """A GGUF file's tensors by name (``read_header`` parses the header; tensors are read on demand)."""

    def __init__(self, path: str | os.PathLike):
        gguf = _gguf()
        self.path = Path(path)
        try:
            metadata, self.tensors = read_header(self.path)
        except (ValueError, OSError, struct.error) as exc:
            raise SplitspecError(f"{self.path}: unreadable GGUF ({exc})") from exc
        self.arch = str(metadata.get("general.architecture", "llama"))
        self.four_bit = {gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1,
                         gguf.GGMLQuantizationType.Q4_K}  # fmt: skip

    def layer_kinds(self, i: int) -> tuple:
        """The kinds of layer ``i``'s projection tensors, in ``PROJECTIONS``' order."""
        return tuple(self._tensor(f"blk.{i}.{p}.weight").tensor_type.name for ps in PROJECTIONS.values() for p in ps)

    def is_four_bit(self, name: str) -> bool:
        return self._tensor(name).tensor_type in self.four_bit

    def is_six_bit(self, name: str) -> bool:
        return self._tensor(name).tensor_type == _gguf().GGMLQuantizationType.Q6_K

    def _tensor(self, name: str):
        if name not in self.tensors:
            raise SplitspecError(f"{self.path}: no tensor {name!r} (a {self.arch} decoder has it)")
        return self.tensors[name]

    def _rows(self, name: str, span: tuple[int, int] | None = None) -> tuple[np.ndarray, int]:
        """The tensor's raw rows [rows, bytes a row] (all, or ``span`` [begin, end)) and its columns (GGUF lists
        dimensions innermost first). Read, not mapped: a mapped file's pages would count as the process's memory."""
        t = self._tensor(name)
        n = int(np.prod(t.shape[1:], dtype=np.int64))
        width = int(t.n_bytes) // n
        begin, end = span or (0, n)
        offset = int(t.data_offset) + begin * width
        data = np.fromfile(self.path, dtype=np.uint8, count=(end - begin) * width, offset=offset)
        return data.reshape(end - begin, width), int(t.shape[0])

    def _hf_order(self, t: torch.Tensor, heads: int | None) -> torch.Tensor:
        """llama's q and k rows back in a Hugging Face checkpoint's order: llama.cpp's converter interleaves each
        head's two rotary halves (qwen2 files are not permuted)."""
        if heads is None or self.arch != "llama":
            return t
        n = t.shape[0]
        return t.reshape(heads, n // heads // 2, 2, -1).transpose(1, 2).reshape(t.shape).contiguous()

    def floats(self, name: str, heads: int | None = None, span: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor (or its rows ``span`` [begin, end)) dequantised to fp32, [rows, cols] or [cols]: exact, every
        GGUF kind's values being fp32 products."""
        gguf = _gguf()
        t = self._tensor(name)
        rows, cols = self._rows(name, span)
        values = torch.empty(rows.shape[0], cols)
        step = max(1, (1 << 22) // cols)  # rows a slice: numpy's dequantisers make several copies of what they read
        for r in range(0, rows.shape[0], step):
            try:
                part = gguf.quants.dequantize(rows[r : r + step], t.tensor_type)
            except NotImplementedError as exc:
                kind = t.tensor_type.name
                raise SplitspecError(f"{self.path}: tensor {name} is {kind}, which cannot be read") from exc
            values[r : r + step] = torch.from_numpy(np.asarray(part, dtype=np.float32).reshape(-1, cols))
        return self._hf_order(values.flatten() if len(t.shape) == 1 else values, heads)

    def blocks(self, name: str, heads: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A 4-bit tensor as (q uint8 [rows, cols] in 0..15, d, m fp32 [rows, cols / 32]): value = d * q + m."""
        gguf = _gguf()
        Q = gguf.GGMLQuantizationType
        t = self._tensor(name)
        if t.tensor_type == Q.Q4_K:  # its block step d·sc and minimum -dmin·mn, in fp32
            q, sc, mn, d, dmin = self.k_blocks(name, heads)
            d, dmin = d.float().repeat_interleave(8, dim=1), dmin.float().repeat_interleave(8, dim=1)
            return q, d * sc.float(), -(dmin * mn.float())
        rows, cols = self._rows(name)
        n = rows.shape[0]
        if t.tensor_type in (Q.Q4_0, Q.Q4_1):  # 32-value blocks: d (fp16), Q4_1's m (fp16), 16 bytes of values
            width = 18 if t.tensor_type == Q.Q4_0 else 20
            b = rows.reshape(-1, width)
            scale = b[:, 0:2].copy().view(np.float16).astype(np.float32)
            low = -8 * scale if t.tensor_type == Q.Q4_0 else b[:, 2:4].copy().view(np.float16).astype(np.float32)
            qs = b[:, width - 16 :].reshape(-1, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)
            q = (qs & 15).reshape(n, cols)
        else:
            raise ValueError(f"tensor {name} is {t.tensor_type.name}, not a 4-bit kind")
        per_block = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32).reshape(n, cols // 32))  # noqa: E731
        q = torch.from_numpy(np.ascontiguousarray(q))
        return tuple(self._hf_order(t, heads) for t in (q, per_block(scale), per_block(low)))

    def k_blocks(self, name: str, heads: int | None = None, span: tuple[int, int] | None = None):
        """A Q4_K tensor (or its rows ``span``) as it is: (q uint8 [rows, cols] in 0..15, sc, mn uint8 [rows, cols / 32]
        in 0..63, d, dmin fp16 [rows, cols / 256]): value = d * sc * q - dmin * mn. A super-block is d, dmin, 12 bytes
        of 6-bit scales and minimums and 128 of values."""
        t = self._tensor(name)
        if t.tensor_type != _gguf().GGMLQuantizationType.Q4_K:
            raise ValueError(f"tensor {name} is {t.tensor_type.name}, not Q4_K")
        rows, cols = self._rows(name, span)
        n = rows.shape[0]
        b = rows.reshape(-1, 144)
        d = b[:, 0:2].copy().view(np.float16).reshape(n, cols // 256)
        dmin = b[:, 2:4].copy().view(np.float16).reshape(n, cols // 256)
        sc, mn = (a.astype(np.uint8).reshape(n, cols // 32) for a in _gguf().quants.Q4_K.get_scale_min(b[:, 4:16]))
        qs = b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        q = (qs & 15).reshape(n, cols)
        return tuple(self._hf_order(torch.from_numpy(np.ascontiguousarray(a)), heads) for a in (q, sc, mn, d, dmin))

    def six_bits(self, name: str, heads: int | None = None, span: tuple[int, int] | None = None):
        """A Q6_K tensor (or its rows ``span``) as (q uint8 [rows, cols] in 0..63, scales int8 [rows, cols / 16], d
        fp16 [rows, cols / 256]): value = d * scale * (q - 32). A super-block is 128 bytes of low 4 bits, 64 of
        high 2 bits, 16 scales and d."""
        t = self._tensor(name)
        if not self.is_six_bit(name):
            raise ValueError(f"tensor {name} is {t.tensor_type.name}, not Q6_K")
        rows, cols = self._rows(name, span)
        n = rows.shape[0]
        b = rows.reshape(-1, 210)
        low = b[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        high = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        q = ((low & 15).reshape(-1, 8, 32) | ((high & 3).reshape(-1, 8, 32) << 4)).reshape(n, cols)
        scales = b[:, 192:208].copy().view(np.int8).reshape(n, cols // 16)
        d = b[:, 208:210].copy().view(np.float16).reshape(n, cols // 256)
        return tuple(self._hf_order(torch.from_numpy(np.ascontiguousarray(a)), heads) for a in (q, scales, d))


def served_share(folder: str | os.PathLike) -> float:
    """The share of a GGUF's projection weights stored in kinds the low-bit path serves as they are (4-bit blocks,
    Q6_K)."""
    ckpt = Checkpoint(source_of(folder))
    total = kept = 0
    for name, t in ckpt.tensors.items():
        if name.startswith("blk.") and name.endswith(".weight") and len(t.shape) == 2:
            total += t.n_elements
            kept += t.n_elements if ckpt.is_four_bit(name) or ckpt.is_six_bit(name) else 0
    return kept / total if total else 0.0


def load(folder: Path, cfg, weights: str) -> dict[str, torch.Tensor]:
    """The tensors of a decoder of ``cfg`` (a ``shared.engine.decoder.ModelConfig``) from the GGUF behind ``folder``, by
    the decoder's names: float tensors in fp32 (``prepare`` casts them), or, for low-bit ``weights``, the projections
    packed for the CPU kernels (``<layer>.qweight``, ``<layer>.qscale``, and ``<layer>.tail.qweight``,
    ``<layer>.tail.qscale`` for the rows of a fused projection packed in a second format); ``load_engine`` puts them
    in. Packed weights are cached in ``folder`` a layer a file as they are made (no whole copy in memory) and served
    memory-mapped from there, the first time as every later one."""
    if weights not in ("int8", "int4", "lowbit"):
        state: dict[str, torch.Tensor] = {}
        for part in _converted(Checkpoint(source_of(folder)), cfg, weights):
            state.update(part)
        return state
    cached = folder / f"weights-{weights}-{kernels.ops().int8_layout()}-v{FORMAT}"
    if not (cached / "complete").is_file():
        tmp = cached.with_name(f".{cached.name}.{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        ckpt = Checkpoint(source_of(folder))
        _write_rows(ckpt, "token_embd.weight", tmp / EMBEDDINGS)
        parts = _converted(ckpt, cfg, weights, embeddings=False)
        for k in itertools.count():  # (not enumerate: its reused tuple would keep the last part alive)
            part = next(parts, None)
            if part is None:
                break
            torch.save(part, tmp / f"part-{k:03d}.pt")
            del part
            _release()
        (tmp / "complete").touch()
        try:
            tmp.rename(cached)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    state = {}
    for f in sorted(cached.glob("part-*.pt")):  # memory-mapped: a load reads only what it touches
        state.update(torch.load(f, mmap=True, weights_only=True))
    # (copy-on-write: a writable array torch takes as it is; nothing writes to it)
    state["embed_tokens.weight"] = torch.from_numpy(np.load(cached / EMBEDDINGS, mmap_mode="c"))
    return state


def _write_rows(ckpt: Checkpoint, name: str, path: Path, step: int = 8192) -> None:
    """A tensor dequantised to fp32 into a ``.npy`` file a slice of rows at a time: the embeddings (150k x 1536 fp32,
    0.9 GB on the 1.5B) never whole in memory, and a load maps them and reads only the rows it looks up."""
    t = ckpt._tensor(name)
    rows, cols = int(t.shape[1]), int(t.shape[0])
    with open(path, "wb") as f:
        np.lib.format.write_array_header_2_0(f, {"descr": "<f4", "fortran_order": False, "shape": (rows, cols)})
        for r in range(0, rows, step):
            f.write(ckpt.floats(name, span=(r, min(rows, r + step))).numpy().tobytes())


def _converted(ckpt: Checkpoint, cfg, weights: str, embeddings: bool = True):
    """The engine's tensors made from the GGUF's, a layer at a time, then the norm, embeddings (unless ``embeddings``
    is False: ``_write_rows`` writes them) and head."""
    lowbit = weights in ("int8", "int4", "lowbit")
    started = time.monotonic()
    for i in range(cfg.num_layers):
        _progress(i, cfg.num_layers, started)
        yield layer_state(ckpt, cfg, i, weights)
    _progress(cfg.num_layers, cfg.num_layers, started)
    yield {"norm.weight": ckpt.floats("output_norm.weight")}
    if embeddings:
        yield {"embed_tokens.weight": ckpt.floats("token_embd.weight")}
    if not cfg.tie_embeddings and lowbit:  # packed at once: a float copy of a 150k-token head would double the memory
        qweight, qscale = head_rows(ckpt, "output.weight", weights)
        yield {"lm_head.qweight": qweight, "lm_head.qscale": qscale}
    elif not cfg.tie_embeddings:
        yield {"lm_head.weight": ckpt.floats("output.weight")}


def layer_state(ckpt: Checkpoint, cfg, i: int, weights: str, name: int | None = None) -> dict[str, torch.Tensor]:
    """Layer ``i``'s tensors by the decoder's names (``layers.<name>.*``, ``name`` defaulting to ``i``), made for
    ``weights`` as ``load`` makes them."""
    heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}
    at = f"layers.{i if name is None else name}"
    state = {f"{at}.{ours}.weight": ckpt.floats(f"blk.{i}.{theirs}.weight") for ours, theirs in NORMS.items()}
    for ours, parts in PROJECTIONS.items():
        names = [f"blk.{i}.{p}.weight" for p in parts]
        if all(f"blk.{i}.{p}.bias" in ckpt.tensors for p in parts):
            state[f"{at}.{ours}.bias"] = torch.cat([ckpt.floats(f"blk.{i}.{p}.bias", heads.get(p)) for p in parts])
        if weights in ("int8", "int4", "lowbit"):
            state.update(_packed(f"{at}.{ours}", ckpt, names, parts, heads, weights))
        else:
            state[f"{at}.{ours}.weight"] = torch.cat([ckpt.floats(n, heads.get(p)) for n, p in
                                                      zip(names, parts, strict=True)])  # fmt: skip
    return state


def sample_layers(kinds: list[tuple], count: int) -> list[int]:
    """``count`` layers of a model whose layers hold tensors of ``kinds`` (a tuple a layer), in the model's own shares
    of them: a file mixes kinds by layer (Q4_K_M keeps half its down projections in Q6_K), and path timing
    extrapolates a few layers' cost to all. Layers alike are grouped; each group gets its share of ``count`` (the
    largest remainders rounded up) from its first layers."""
    if not 0 < count <= len(kinds):
        raise ValueError(f"{count} layers of {len(kinds)}: expected 1 to {len(kinds)}")
    groups: dict[tuple, list[int]] = {}
    for i, k in enumerate(kinds):
        groups.setdefault(k, []).append(i)
    shares = {k: len(v) * count / len(kinds) for k, v in groups.items()}
    taken = {k: int(s) for k, s in shares.items()}
    for k in sorted(groups, key=lambda k: taken[k] - shares[k])[: count - sum(taken.values())]:
        taken[k] += 1
    return sorted(i for k, v in groups.items() for i in v[: taken[k]])


def _release() -> None:
    """Hand freed memory back to the system (glibc keeps what numpy's many temporaries freed)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def head_rows(ckpt: Checkpoint, name: str, weights: str, count: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The LM head (its first ``count`` rows, a multiple of 16; default all) packed for the low-bit ``weights``, a
    slice of rows at a time (rows are independent): no fp32 copy of it. Q6_K is served as it is (``lowbit``); else
    int8 (a scale per row), or int4 when pinned (a drafter's head, where rounding it again costs nothing but drafts)."""
    t = ckpt.tensors[name]
    rows, cols, step = int(t.shape[1]), int(t.shape[0]), 8192  # a multiple of every layout's tile
    if count is not None and (count % 16 or not 0 < count <= rows):
        raise ValueError(f"{count} head rows of {rows}: expected a multiple of 16 up to {rows}")
    if weights == "lowbit" and ckpt.is_six_bit(name) and rows % 16 == 0:  # (the whole head's rows decide its format)
        pack = lambda span: pack_int6_blocks(*ckpt.six_bits(name, span=span))  # noqa: E731
    elif weights == "int4" and rows % 16 == 0 and cols % 32 == 0:
        pack = lambda span: pack_int4(ckpt.floats(name, span=span))  # noqa: E731
    else:
        pack = lambda span: pack_int8(ckpt.floats(name, span=span), kernels.ops().int8_layout())  # noqa: E731
    rows = rows if count is None else count
    parts = [pack((r, min(rows, r + step))) for r in range(0, rows, step)]
    return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])


def _packed(prefix, ckpt, names, parts, heads, weights) -> dict[str, torch.Tensor]:
    """One fused projection packed for the kernels: int4 from its 4-bit blocks as they are (``int4``, ``lowbit``; Q4_K
    at its own 4.5 bits), int6 from Q6_K as it is (``lowbit``), two of those side by side where the tensors are of two
    such kinds (q and k Q4_K, v Q6_K: the rows after the first kind's are the layer's ``tail``), else int8 (or int4
    when pinned) from its exact fp32 values."""
    Q4_K = _gguf().GGMLQuantizationType.Q4_K

    def kind(name: str) -> str | None:  # how a tensor is served as it is, if it can be
        if weights in ("int4", "lowbit") and ckpt.tensors[name].tensor_type == Q4_K:
            return "int4k"
        if weights in ("int4", "lowbit") and ckpt.is_four_bit(name):
            return "int4"
        return "int6" if weights == "lowbit" and ckpt.is_six_bit(name) else None

    formats = {"int4k": (ckpt.k_blocks, pack_int4k_blocks), "int4": (ckpt.blocks, pack_int4_blocks),
               "int6": (ckpt.six_bits, pack_int6_blocks)}  # fmt: skip

    def pack(how: str, ns, ps) -> tuple[torch.Tensor, torch.Tensor] | None:
        if sum(int(ckpt.tensors[n].shape[1]) for n in ns) % 16:
            return None  # the kernels' tiles are 16 rows
        read, pack_as = formats[how]
        return pack_as(*[torch.cat(t) for t in zip(*(read(n, heads.get(p)) for n, p in zip(ns, ps, strict=True)),
                                                   strict=True)])  # fmt: skip

    kinds = [kind(n) for n in names]
    if (None not in kinds and len(set(kinds)) == 1) or set(kinds) == {"int4k", "int4"}:  # one format for all
        packed = pack(kinds[0] if len(set(kinds)) == 1 else "int4", names, parts)
        if packed is not None:
            return {f"{prefix}.qweight": packed[0], f"{prefix}.qscale": packed[1]}
    cut = next((i for i in range(1, len(names)) if kinds[i] != kinds[0]), len(names))
    if None not in kinds and len(set(kinds[cut:])) == 1:  # two formats, one after the other: a head and a tail
        head, tail = pack(kinds[0], names[:cut], parts[:cut]), pack(kinds[cut], names[cut:], parts[cut:])
        if head is not None and tail is not None:
            return {f"{prefix}.qweight": head[0], f"{prefix}.qscale": head[1],
                    f"{prefix}.tail.qweight": tail[0], f"{prefix}.tail.qscale": tail[1]}  # fmt: skip
    w = torch.cat([ckpt.floats(n, heads.get(p)) for n, p in zip(names, parts, strict=True)])
    fits = w.shape[0] % 16 == 0 and w.shape[1] % 32 == 0
    qweight, qscale = pack_int4(w) if weights == "int4" and fits else pack_int8(w, kernels.ops().int8_layout())
    return {f"{prefix}.qweight": qweight, f"{prefix}.qscale": qscale}


def _progress(done: int, total: int, started: float) -> None:
    if sys.stderr.isatty() or done == total:
        end = "\n" if done == total else "\r"
        print(f"splitspec: converting GGUF layers {done}/{total} ({time.monotonic() - started:.0f} s)",
              end=end, file=sys.stderr, flush=True)  # fmt: skip
