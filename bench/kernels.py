"""Candidate low-bit CPU matmul paths on the target's own shapes (``make bench-kernels``): what the int8 path rests on.

All 30 layers' projections of SmolLM2-135M (qkv 960×576, o 576×576, gate/up 3072×576, down 576×1536, distinct
random weights per layer, so they stream from memory as in a forward) at M = ``--rows`` (1,5,17,33) activation
rows, ``--threads`` threads, medians of ``--repeats``. Per candidate: ms for all 120 matmuls, the weight bytes
streamed per ms at M=1, and whether a row's result is bit-identical whatever rows share the call (the exactness
the engine needs: checked, not assumed):

* ``torch fp32``        ``F.linear`` (MKL on x86);
* ``splitspec int8``    ``torch.ops.splitspec.linear``: int8 weights (a scale per row), each activation row
                        int8 with its own scale, exact int32 sums (``shared/engine/kernels/cpu.cpp``);
* ``splitspec int4``    the same kernels on Q4_1 weights (blocks of 32, fp16 scale and minimum);
* ``fbgemm int8``       ``torch.ao`` dynamic quantisation (int8 weights, int8 activations with one scale for
                        the whole call, int32 sums) — when torch has the fbgemm engine;
* ``onnxruntime q4``    ONNX Runtime's ``MatMulNBits`` (4-bit weights, blocks of 32, ``accuracy_level=4``: int8
                        activations per block) in one graph of the 120 matmuls — when onnxruntime and onnx are
                        installed (they are not dependencies: ``pip install onnxruntime onnx``).

Run:  .venv/bin/python -m bench.kernels [--rows 1,5,17,33] [--repeats 9]
Writes kernels.json and kernels.md under --out (default bench/results).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from bench.common import environment, save_results
from shared.engine import kernels
from shared.engine.quant import pack_int4, pack_int8

REPO = Path(__file__).resolve().parents[1]
E, FF, LAYERS = 576, 1536, 30
SHAPES = [(960, E), (E, E), (2 * FF, E), (E, FF)]  # (out, in) per layer


def weights(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, k, generator=g) * 0.05 for _ in range(LAYERS) for n, k in SHAPES]


def inputs(m: int) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(m)
    return {k: torch.randn(m, k, generator=g) for k in (E, FF)}


class Candidate:
    """A way to run the 120 matmuls: ``run(xs) -> outputs`` for activation rows keyed by input width."""

    name = ""
    bytes_per_weight = 4.0

    def run(self, xs: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        raise NotImplementedError


class TorchFp32(Candidate):
    name = "torch fp32 (MKL)"

    def __init__(self, ws):
        self.ws = ws

    def run(self, xs):
        return [F.linear(xs[w.shape[1]], w) for w in self.ws]


class SplitspecInt8(Candidate):
    name = "splitspec int8 (per-row activations)"
    bytes_per_weight = 1.0

    def __init__(self, ws):
        layout = kernels.ops().int8_layout()
        self.packed = [(w.shape[1], *pack_int8(w, layout)) for w in ws]

    def run(self, xs):
        return [kernels.ops().linear(xs[k], q, s, None, None) for k, q, s in self.packed]


class SplitspecInt4(SplitspecInt8):
    name = "splitspec int4 (Q4_1 blocks, per-block activations)"
    bytes_per_weight = 0.5 + 4 / 32

    def __init__(self, ws):
        self.packed = [(w.shape[1], *pack_int4(w)) for w in ws]


class FbgemmInt8(Candidate):
    name = "fbgemm int8 (torch.ao dynamic, per-call activations)"
    bytes_per_weight = 1.0

    def __init__(self, ws):
        from torch.ao.quantization import quantize_dynamic

        torch.backends.quantized.engine = "fbgemm"
        self.layers = []
        for w in ws:
            lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
            lin.weight.data.copy_(w)
            self.layers.append((w.shape[1], quantize_dynamic(torch.nn.Sequential(lin), {torch.nn.Linear})))

    def run(self, xs):
        return [layer(xs[k]) for k, layer in self.layers]


class OnnxQ4(Candidate):
    name = "onnxruntime MatMulNBits q4 (int8 compute)"
    bytes_per_weight = 0.5 + 4 / 32

    def __init__(self, ws, threads: int, m: int):
        import onnxruntime as ort
        from onnx import TensorProto, helper

        nodes, inits, outputs = [], [], []
        x = {k: helper.make_tensor_value_info(f"x{k}", TensorProto.FLOAT, [m, k]) for k in (E, FF)}
        for i, w in enumerate(ws):
            n, k = w.shape
            blocks = k // 32
            wb = w.numpy().reshape(n, blocks, 32)
            scale = np.maximum(np.abs(wb).max(-1), 1e-12) / 7
            q = (np.clip(np.round(wb / scale[..., None]), -8, 7) + 8).astype(np.uint8)
            packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
            inits += [helper.make_tensor(f"b{i}", TensorProto.UINT8, packed.shape, packed.tobytes(), raw=True),
                      helper.make_tensor(f"s{i}", TensorProto.FLOAT, [n * blocks], scale.astype(np.float32).ravel())]
            nodes.append(helper.make_node("MatMulNBits", [f"x{k}", f"b{i}", f"s{i}"], [f"y{i}"], domain="com.microsoft",
                                          K=k, N=n, bits=4, block_size=32, accuracy_level=4))  # fmt: skip
            outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [m, n]))
        graph = helper.make_graph(nodes, "projections", list(x.values()), outputs, inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                         helper.make_opsetid("com.microsoft", 1)])  # fmt: skip
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        self.session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])

    def run(self, xs):
        outs = self.session.run(None, {f"x{k}": v.numpy() for k, v in xs.items()})
        return [torch.from_numpy(o) for o in outs]


def timed(fn: Callable[[], object], repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def row_invariant(make: Callable[[int], Candidate], m: int) -> bool:
    """Each row of an m-row call equals the same row computed alone, bit for bit."""
    xs = inputs(m)
    together = make(m).run(xs)
    alone = make(1)
    for r in range(m):
        single = alone.run({k: v[r : r + 1] for k, v in xs.items()})
        if not all(torch.equal(a[0], t[r]) for a, t in zip(single, together, strict=True)):
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,5,17,33", help="activation rows per call, comma list (default 1,5,17,33)")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = p.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    torch.set_num_threads(args.threads)
    env = environment(args.threads)
    env["kernels"] = kernels.isa() if kernels.available() else f"unavailable: {kernels.unavailable_reason()}"
    ws = weights()
    makers: dict[str, Callable[[int], Candidate]] = {"torch fp32 (MKL)": lambda m: TorchFp32(ws)}
    if kernels.available():
        int8, int4 = SplitspecInt8(ws), SplitspecInt4(ws)
        makers[SplitspecInt8.name] = lambda m: int8
        makers[SplitspecInt4.name] = lambda m: int4
    if "fbgemm" in torch.backends.quantized.supported_engines:
        fb = FbgemmInt8(ws)
        makers[FbgemmInt8.name] = lambda m: fb
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401

        makers[OnnxQ4.name] = lambda m: OnnxQ4(ws, args.threads, m)
    except ImportError:
        print("onnxruntime/onnx not installed: its row is skipped", file=sys.stderr)
    weight_count = sum(n * k for n, k in SHAPES) * LAYERS
    results = {}
    for name, make in makers.items():
        per_rows = {}
        for m in rows:
            candidate, xs = make(m), inputs(m)
            per_rows[m] = timed(lambda c=candidate, xs=xs: c.run(xs), args.repeats)
        cls = next(c for c in (TorchFp32, SplitspecInt8, SplitspecInt4, FbgemmInt8, OnnxQ4) if c.name == name)
        streamed = weight_count * cls.bytes_per_weight / 1e6  # MB
        results[name] = {"ms": per_rows, "gb_per_s_at_1": streamed / per_rows[1] if 1 in per_rows else None,
                         "row_invariant": row_invariant(make, 5)}  # fmt: skip
        print(name, per_rows, file=sys.stderr)
    lines = [f"All 30 layers' projections of SmolLM2-135M on {env['cpu']} (kernels: {env['kernels']}), "
             f"{args.threads} threads, medians of {args.repeats} ({env['date']}; `{env['command']}`).", "",
             "| candidate | " + " | ".join(f"M={m} ms" for m in rows) + " | GB/s at M=1 | rows batch-invariant |",
             "|---|" + "---:|" * len(rows) + "---:|---|"]  # fmt: skip
    for name, r in results.items():
        rate = "–" if r["gb_per_s_at_1"] is None else f"{r['gb_per_s_at_1']:.1f}"
        lines.append(f"| {name} | " + " | ".join(f"{r['ms'][m]:.1f}" for m in rows)
                     + f" | {rate} | {'yes' if r['row_invariant'] else 'no'} |")  # fmt: skip
    md = "\n".join(lines) + "\n"
    save_results(args.out, "kernels", {"environment": env, "rows": rows, "results": results}, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
