"""attend() alone: T rows after S cached slots (12 heads, 2 kv heads, d 128, fp16 cache), builds alternating."""
import sys, time, statistics, torch
sys.path.insert(0, "/work/main")
from shared.engine import kernels
torch.set_num_threads(2)
tags = sys.argv[1].split(","); S = int(sys.argv[2]); Ts = [int(t) for t in sys.argv[3].split(",")]
H, KV, d = 12, 2, 128
g = torch.Generator().manual_seed(0)
k = (torch.randn(KV, S + 64, d, generator=g)).half(); v = torch.randn(KV, S + 64, d, generator=g).half()
res = {}
for T in Ts:
    qkv = torch.randn(T, (H + 2 * KV) * d, generator=g)
    cos, sin = torch.randn(T, d, generator=g), torch.randn(T, d, generator=g)
    outs = {}
    samples = {t: [] for t in tags}
    for r in range(9):
        for t in (tags if r % 2 else tags[::-1]):
            op = kernels.ops(t).attend
            kk, vv = k.clone(), v.clone()
            t0 = time.perf_counter()
            for _ in range(5):
                o = op(qkv, cos, sin, kk, vv, S, None, H, KV, d ** -0.5)
            samples[t].append((time.perf_counter() - t0) / 5 * 1e3)
            outs[t] = o
    base = statistics.median(samples[tags[0]])
    flops = T * H * (S + T) * d * 2 * 2
    line = [f"T={T} S={S}:"]
    for t in tags:
        ms = statistics.median(samples[t])
        line.append(f"{t} {ms:.3f} ms ({flops / ms / 1e6:.1f} GFLOP/s, {ms/base:.3f}x, same={torch.equal(outs[t], outs[tags[0]])})")
    print(" ".join(line), flush=True)
