"""The 0.5B drafter's proposals with the whole int8 head against the draft vocabulary's cut head, interleaved."""
import sys, statistics, time, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[4]))
from shared.engine.models import load_target
from client.drafters.model import ModelDrafter
from bench.engine import prefix_tokens
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
lm = load_target("qwen2.5-coder-0.5b", dtype="float32", weights="lowbit")
prompt = prefix_tokens(lm.tokenizer, 200)
ds = {"whole": ModelDrafter(lm, vocab=None), "cut": ModelDrafter(lm)}
print("cut head:", tuple(ds["cut"].vocabulary[2].qweight.shape), flush=True)
for d in ds.values():
    d.begin(prompt)
res = {k: [] for k in ds}
trees = {}
for r in range(15):
    for k in (ds if r % 2 else reversed(list(ds))):
        t0 = time.perf_counter()
        for _ in range(3):
            tree = ds[k].propose(8)
        res[k].append((time.perf_counter() - t0) / 3 * 1e3)
        trees[k] = tree.tokens
a, b = statistics.median(res["whole"]), statistics.median(res["cut"])
print(f"propose(8), width 2 depth 5: whole head {a:.1f} ms, cut {b:.1f} ms, {b/a:.3f}x; same tree: {trees['whole'] == trees['cut']}")
