"""CUDA graphs for the decoder's dense steps, per row bucket (vLLM v1's piecewise graphs, in small).

On a GPU a small model's forward is bound by launching its kernels, not by running them: the 1.5B's step is about
fifty launches a layer. Between one layer's attention and the next everything is dense and row by row (the output
projection and residual, the norm, the MLP and residual, the next norm, the fused QKV and its rotation), so that
stretch is captured once per row bucket and replayed. Attention runs between the replays as it does without graphs
(the forward's ``attend``: its sequences one at a time, or as padded groups, ``shared.engine.padded``), since the
caches' lengths change every step.

Rows are padded to their bucket. Where rows are independent (exact bf16: ``exact_rows``' fixed blocks, fp64 norms)
a padded row changes no real row, and the steps are the eager code's, so a forward on graphs gives eager's bits
(tested on the CPU, where the same program runs uncaptured). Elsewhere a bucket's shapes may round otherwise.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

# rows a captured forward takes (larger forwards run eagerly): 16 clients' 16-node trees fit 384
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 384, 512)


@dataclass
class Buffers:
    """One bucket's static tensors: what a replay reads and writes (a captured graph holds their addresses)."""

    x: torch.Tensor  # [1, b, E] the residual stream
    cos: torch.Tensor  # [1, b, d] rotation tables of the forward's positions
    sin: torch.Tensor
    qk: torch.Tensor  # [1, b, H + kv, d] rotated queries and keys (``Attention.rotated``)
    v: torch.Tensor  # [1, b, kv, d]
    attended: torch.Tensor  # [1, b, H·d] attention's output, written between replays
    out: torch.Tensor  # [1, b, E] the final norm's output


class Graphs:
    """A ``Transformer``'s forwards of up to ``buckets[-1]`` rows on captured steps (``Transformer.forward_many`` takes
    them when set: ``use_graphs``). A bucket's steps are captured the first time a forward needs them; forwards run
    one at a time (one set of buffers a bucket)."""

    def __init__(self, model, buckets: tuple[int, ...] = BUCKETS, capture: bool | None = None) -> None:
        if not buckets or any(b < 1 for b in buckets):
            raise ValueError(f"buckets {buckets!r}: expected row counts of at least 1")
        self.model = model
        self.buckets = tuple(sorted(set(buckets)))
        self.capture = model.device.type == "cuda" if capture is None else capture
        if self.capture and model.device.type != "cuda":
            raise ValueError(f"CUDA graphs capture on a CUDA device; this model is on {model.device}")
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None  # one pool: steps run one at a time
        self.captured: dict[int, tuple[Buffers, list[Callable[[], None]]]] = {}
        self._lock = threading.Lock()

    def warm(self) -> Graphs:
        """Capture every bucket now: a server does it before it serves, so that no capture ever runs beside another
        thread's CUDA work (a capture forbids it)."""
        with self._lock:
            for b in self.buckets:
                self._steps(b)
        return self

    def fits(self, rows: int) -> bool:
        return rows <= self.buckets[-1]

    def bucket(self, rows: int) -> int:
        """The smallest bucket that holds ``rows``."""
        for b in self.buckets:
            if b >= rows:
                return b
        raise ValueError(f"a forward of {rows} rows is past the largest bucket ({self.buckets[-1]})")

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attend: Callable) -> torch.Tensor:
        """Final (normed) hidden states [T, E] of embeddings x [1, T, E]; ``attend(i, attn, q, k, v)`` is layer i's
        attention for the real rows ([1, T, H·d]: ``forward_many``'s, each sequence over its own cache)."""
        rows = x.shape[1]
        with self._lock:
            bufs, steps = self._steps(self.bucket(rows))
            bufs.x[:, :rows].copy_(x)
            bufs.x[:, rows:].zero_()
            bufs.cos[:, :rows].copy_(rope[0])
            bufs.sin[:, :rows].copy_(rope[1])
            for i, layer in enumerate(self.model.layers):
                steps[i]()
                attn = layer.self_attn
                bufs.attended[:, :rows] = attend(i, attn, *attn.heads_of(bufs.qk, bufs.v))
            steps[-1]()
            return bufs.out[0, :rows].clone()

    def _steps(self, bucket: int) -> tuple[Buffers, list[Callable[[], None]]]:
        if bucket not in self.captured:
            self.captured[bucket] = self._capture(bucket)
        return self.captured[bucket]

    def _capture(self, bucket: int) -> tuple[Buffers, list[Callable[[], None]]]:
        """A bucket's buffers and its L + 1 steps: step i finishes layer i - 1 (after its attention) and begins layer i
        (up to its attention); the last one finishes the last layer and applies the final norm."""
        m = self.model
        cfg, dev, dtype = m.cfg, m.device, m.dtype
        H, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

        def empty(*shape: int) -> torch.Tensor:
            return torch.zeros(1, bucket, *shape, dtype=dtype, device=dev)

        bufs = Buffers(empty(cfg.hidden_size), empty(d), empty(d), empty(H + kv, d), empty(kv, d), empty(H * d),
                       empty(cfg.hidden_size))  # fmt: skip
        layers = list(m.layers)

        def step(i: int) -> Callable[[], None]:
            def run() -> None:
                x = bufs.x
                if i > 0:
                    x = layers[i - 1].after_attention(x, bufs.attended)
                if i == len(layers):
                    bufs.out.copy_(m.norm(x))
                    return
                if i > 0:
                    bufs.x.copy_(x)
                qk, v = layers[i].self_attn.rotated(layers[i].input_layernorm(x), (bufs.cos, bufs.sin))
                bufs.qk.copy_(qk)
                bufs.v.copy_(v)

            return self._graph(run) if self.capture else run

        return bufs, [step(i) for i in range(len(layers) + 1)]

    def _graph(self, run: Callable[[], None]) -> Callable[[], None]:
        """``run`` captured: warmed once on a side stream (cuBLAS's handles and workspaces come before a capture, as
        torch.cuda.graphs asks), then recorded into the shared pool; its replay."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            run()
        return graph.replay


def use_graphs(model, buckets: tuple[int, ...] = BUCKETS, capture: bool | None = None) -> Graphs:
    """Serve ``model``'s forwards of up to ``buckets[-1]`` rows on graphs (``capture=False``: the same static-buffer
    program uncaptured, what the CPU tests check)."""
    model.graphs = Graphs(model, buckets, capture)
    return model.graphs
