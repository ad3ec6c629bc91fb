"""Several sequences' attention as one padded batch: a forward of many sessions at the cost of a few.

``Transformer.forward_many`` reads the weights once for all its sequences, but attention needs each sequence's own
cache. Run one sequence at a time, that is about ten launches a sequence a layer, from Python: on the H200 this, not
the GPU, held the batched server at ~500 tokens a second from 16 clients on (bench/results/gpu-h200). Here a group of
sequences' caches is copied once a forward into one padded tensor of all layers, [L, P, kv, S, d]; each layer writes
its new keys and values into it in one indexing op and attends every sequence in one call under a padded mask; after
the last layer the new entries go back into each sequence's cache. The Python work is per sequence a forward, not per
sequence a layer.

Exact where it runs: in fp64 (the exact bf16 recipe's cache: ``load_engine``) a query's result differs from its
unpadded one only in the order of an fp64 sum that gained zero terms, ~1e-16 relative, far below a bf16 step, the
argument that makes tree verification equal plain decoding. An fp32 or bf16 cache may round otherwise, so on a CPU
(where an fp32 model's batches are exact, and a bf16 model's attention runs in the kernels) sequences keep their own
attention; on a GPU, where an inexact model's rows depend on the batch anyway, they are padded too.
"""

from __future__ import annotations

import torch

from shared.engine.layers import Span, attend_spans

BUDGET_BYTES = 2 << 30  # a group's padded keys and values; more sequences make several groups


def applies(parts: list, device: torch.device) -> bool:
    """Whether ``parts`` (``shared.engine.decoder.Part``) attend as padded groups (see the module's docstring)."""
    caches = [p.cache for p in parts]
    return (len(parts) > 1 and all(c.k.shape[1] == 1 for c in caches)
            and (device.type == "cuda" or all(c.k.dtype == torch.float64 for c in caches)))  # fmt: skip


class Padded:
    """One group of a forward's sequences: rows [first, last) of the forward, padded to S cache slots each."""

    def __init__(self, parts: list, bounds: list[tuple[int, int]]) -> None:
        self.parts, self.bounds = parts, bounds
        self.first, self.last = bounds[0][0], bounds[-1][1]
        if len(parts) == 1:  # a sequence alone (a long one, past the budget) attends over its own cache, uncopied
            return
        ref = parts[0].cache.k
        dev, L, kv, d = ref.device, ref.shape[0], ref.shape[2], ref.shape[4]
        sizes = [b - a for a, b in bounds]
        ends = [p.at + n for p, n in zip(parts, sizes, strict=True)]
        P, S, T = len(parts), max(ends), max(sizes)
        self.k = ref.new_zeros(L, P, kv, S, d)  # zeros, not empty: a masked slot's value still meets a zero weight
        self.v = ref.new_zeros(L, P, kv, S, d)
        past = [(j, p) for j, p in enumerate(parts) if p.at]
        for pad, name in ((self.k, "k"), (self.v, "v")) if past else ():
            torch._foreach_copy_([pad[:, j, :, : p.at] for j, p in past],
                                 [getattr(p.cache, name)[:, 0, :, : p.at] for _, p in past])  # fmt: skip
        # where each of the group's rows goes: (sequence, slot) in the padded cache, (sequence, row) in the queries
        seq = [j for j, n in enumerate(sizes) for _ in range(n)]
        self.seq = torch.tensor(seq, device=dev)
        self.slot = torch.tensor([p.at + t for p, n in zip(parts, sizes, strict=True) for t in range(n)], device=dev)
        rows = torch.zeros(P, T, dtype=torch.long)
        for j, (a, b) in enumerate(bounds):
            rows[j, : b - a] = torch.arange(a - self.first, b - self.first)
        self.rows = rows.to(dev)
        self.real = torch.tensor([j * T + t for j, n in enumerate(sizes) for t in range(n)], device=dev)
        self.mask = torch.zeros(P, T, S, dtype=torch.bool, device=dev)
        self.mask[:, :, 0] = True  # a padding row sees one slot, so that its softmax is finite (it is dropped)
        for j, (p, n) in enumerate(zip(parts, sizes, strict=True)):
            self.mask[j, :n, : p.at + n] = True if p.mask is None else p.mask[0]

    @staticmethod
    def groups(parts: list, bounds: list[tuple[int, int]], budget: int = BUDGET_BYTES) -> list[Padded]:
        """``parts`` in consecutive groups whose padded keys and values each fit ``budget`` bytes (a sequence alone
        may pass it: it has to attend somewhere)."""
        out, start, widest = [], 0, 0
        for j, ((a, b), p) in enumerate(zip(bounds, parts, strict=True)):
            c = p.cache.k
            per_slot = 2 * c.shape[0] * c.shape[2] * c.shape[4] * c.element_size()
            widest = max(widest, p.at + b - a)
            if j > start and (j + 1 - start) * widest * per_slot > budget:
                out.append(Padded(parts[start:j], bounds[start:j]))
                start, widest = j, p.at + b - a
        out.append(Padded(parts[start:], bounds[start:]))
        return out

    def attend(self, i: int, attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Layer ``i``'s attention for the group's rows of q [1, H, R, d], k, v [1, kv, R, d] (``attn``: the layer's
        ``Attention``): their keys and values into the padded cache, then [1, rows, H·d] as ``Attention.attention``
        gives it."""
        a, b = self.first, self.last
        if len(self.parts) == 1:
            p = self.parts[0]
            return attend_spans(attn, q, k, v, [Span(a, b, p.cache.layers[i], p.at, p.mask)])
        pad_k, pad_v = self.k[i], self.v[i]
        pad_k[self.seq, :, self.slot] = k[0, :, a:b].transpose(0, 1).to(pad_k.dtype)
        pad_v[self.seq, :, self.slot] = v[0, :, a:b].transpose(0, 1).to(pad_v.dtype)
        queries = q[0, :, a:b][:, self.rows].transpose(0, 1)  # [P, H, T, d]
        out = attn.attention(queries, pad_k, pad_v, self.mask)  # [P, T, H·d]
        return out.flatten(0, 1)[self.real][None]

    def finish(self) -> None:
        """The forward's new keys and values into each sequence's own cache (room made: ``Step.part``)."""
        if len(self.parts) == 1:
            return  # (written as it attended)
        new = [(j, p, p.at, p.at + b - a) for j, ((a, b), p) in enumerate(zip(self.bounds, self.parts, strict=True))]
        for pad, name in ((self.k, "k"), (self.v, "v")):
            torch._foreach_copy_([getattr(p.cache, name)[:, 0, :, s:e] for _, p, s, e in new],
                                 [pad[:, j, :, s:e] for j, _, s, e in new])  # fmt: skip
