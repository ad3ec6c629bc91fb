"""Payloads: what the server tells the client's drafter about newly cached tokens, over the wire.

The words: a drafter *needs* the target's ``Features`` (``shared.features``) of the tokens it
drafts after; a ``PayloadSpec`` (form, precision, TLI layers, drafter) says which of them cross
the link and how; the *payload* is the encoded message itself (``pb.Payload``).

One place for both sides and the adaptive policy: the table of forms (``FORMS``: which tensors
each carries, their shapes, what the target must keep to make them), how they are encoded
(``shared.codec``, one blob per tensor) and how a received payload is checked and turned back
into ``Features``.

* ``kv``      every layer's KV per token, ``[n, L, 2·n_kv·d]``; the client runs LSA itself
              (and takes its TLI layers' KV from the same tensor).
* ``lsa``     the server runs the drafter's LSA and ships one memory vector per token, ``[n, E]``,
              plus ``tli_kv`` — the last N layers' KV, ``[n, N, 2·n_kv·d]`` — when TLI=N > 0.
* ``hidden``  the target's final hidden state per token, ``[n, E]`` (what EAGLE drafts from).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shared import codec
from shared.codec import CodecError
from shared.features import Features
from shared.wire import splitspec_pb2 as pb


@dataclass(frozen=True)
class Form:
    """One payload form: the tensor it is named for, and what the target must keep per token to make it."""

    tensor: str  # "kv", "memory" or "hidden"
    keeps: str  # "kv" (its KV cache: every session has it) or "hidden" (its final hidden states)
    tli: bool  # carries the last N layers' KV as well (``tli_kv``) when the spec has tli_layers = N


FORMS = {"kv": Form("kv", "kv", tli=False), "lsa": Form("memory", "kv", tli=True),
         "hidden": Form("hidden", "hidden", tli=True)}  # fmt: skip
DEFAULT_PRECISION = "fp16"
PRECISION_BYTES = {"fp32": 4.0, "fp16": 2.0, "int8": 1.0, "int4": 0.5}  # per value, before zstd


@dataclass(frozen=True)
class PayloadSpec:
    form: str = ""  # which features cross: "kv", "lsa" or "hidden"; "" asks for nothing
    precision: str = DEFAULT_PRECISION
    tli_layers: int = 0
    drafter: str = ""  # form lsa: whose LSA the server runs

    def __post_init__(self) -> None:
        if self.form and self.form not in FORMS:
            raise ValueError(f"payload form {self.form!r} is not one of {', '.join(FORMS)}")
        if self.precision not in codec.PRECISIONS:
            raise ValueError(f"payload precision {self.precision!r} is not one of {', '.join(codec.PRECISIONS)}")
        if self.tli_layers < 0:
            raise ValueError(f"tli_layers must be >= 0, got {self.tli_layers}")
        if self.form == "lsa" and not self.drafter:
            raise ValueError("payload form 'lsa' needs the drafter whose LSA the server should run")

    def __bool__(self) -> bool:
        return bool(self.form)

    def to_msg(self) -> pb.PayloadSpec:
        return pb.PayloadSpec(form=self.form, precision=self.precision, tli_layers=self.tli_layers,
                              drafter=self.drafter)  # fmt: skip

    @classmethod
    def from_msg(cls, msg: pb.PayloadSpec) -> PayloadSpec:
        """Raises ValueError naming the bad field (the server answers INVALID_ARGUMENT with it)."""
        return cls(msg.form, msg.precision or DEFAULT_PRECISION, msg.tli_layers, msg.drafter)


def tensors_for(spec: PayloadSpec, kv: torch.Tensor, hidden: torch.Tensor | None, lsa=None) -> dict[str, torch.Tensor]:
    """The named tensors ``spec`` asks for, from the target's features of n tokens (``kv`` [n, L, Ekv])."""
    if spec.form == "kv":
        return {"kv": kv}
    out = {}
    if spec.form == "lsa":
        if lsa is None:
            raise ValueError(f"payload form 'lsa' needs the LSA of {spec.drafter!r} loaded")
        with torch.inference_mode():
            out["memory"] = lsa.memory(kv.to(next(lsa.parameters()).dtype))
    elif spec.form == "hidden":
        if hidden is None:
            raise ValueError("payload form 'hidden' needs the target's hidden states")
        out["hidden"] = hidden
    if spec.tli_layers:
        out["tli_kv"] = kv[:, kv.shape[1] - spec.tli_layers :]
    return out


def encode(start: int, tensors: dict[str, torch.Tensor], precision: str) -> pb.Payload:
    count = next(iter(tensors.values())).shape[0] if tensors else 0
    encoded = [pb.Tensor(name=k, data=codec.encode(v, precision)) for k, v in tensors.items()]
    return pb.Payload(start=start, count=count, tensors=encoded)


def feature_kinds(spec: PayloadSpec) -> frozenset[str]:
    """What a target session must keep to serve ``spec`` ("kv" and/or "hidden")."""
    return frozenset({FORMS[spec.form].keeps}) if spec else frozenset()


def expected_shapes(spec: PayloadSpec, count: int, num_layers: int, kv_width: int, hidden_size: int) -> dict:
    """{name: shape} a payload of ``count`` tokens must hold for ``spec`` on a target of these dimensions."""
    if not spec:
        return {}
    per_token = {"kv": (num_layers, kv_width), "memory": (hidden_size,), "hidden": (hidden_size,)}
    form = FORMS[spec.form]
    shapes = {form.tensor: (count, *per_token[form.tensor])}
    if form.tli and spec.tli_layers:
        shapes["tli_kv"] = (count, spec.tli_layers, kv_width)
    return shapes


def raw_bytes_per_token(spec: PayloadSpec, num_layers: int, kv_width: int, hidden_size: int) -> float:
    """Bytes one token's payload holds before zstd (int8/int4 scales ignored): sizes and compares forms."""
    values = sum(math.prod(s) for s in expected_shapes(spec, 1, num_layers, kv_width, hidden_size).values())
    return values * PRECISION_BYTES[spec.precision]


def decode(msg: pb.Payload, shapes: dict[str, tuple[int, ...]]) -> Features:
    """``Features`` from a received payload, every tensor checked against ``shapes``; CodecError if anything is off."""
    names = [t.name for t in msg.tensors]
    if sorted(names) != sorted(shapes):
        raise CodecError(f"payload carries tensors {names}, expected {sorted(shapes)}")
    got = {t.name: codec.decode(t.data, expect_shape=shapes[t.name]) for t in msg.tensors}
    return Features(msg.start, kv=got.get("kv"), hidden=got.get("hidden"), memory=got.get("memory"),
                    tli_kv=got.get("tli_kv"))  # fmt: skip


def concat(parts: list[Features]) -> Features:
    """One Features from consecutive chunks (FetchPayload streams a long range in pieces)."""
    if not parts:
        raise CodecError("an empty payload stream")
    for before, after in zip(parts, parts[1:], strict=False):
        if after.start != before.start + len(before):
            raise CodecError(f"payload chunks are not consecutive: {before.start}+{len(before)} then {after.start}")

    def cat(name: str):
        values = [getattr(p, name) for p in parts]
        return None if values[0] is None else torch.cat(values)

    return Features(parts[0].start, kv=cat("kv"), hidden=cat("hidden"), memory=cat("memory"), tli_kv=cat("tli_kv"))
