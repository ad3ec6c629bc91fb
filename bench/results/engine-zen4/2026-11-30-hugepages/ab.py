"""A/B through prepare: SPLITSPEC_HUGE_PAGES=0 for one target, on for the other; interleaved in one process."""
import os, sys, statistics, time, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[4]))
from shared.engine import hugepages
from bench.engine import balanced_tree, prefix_tokens, interleaved_ms
from shared.engine.models import load_target
torch.set_num_threads(2)
model = sys.argv[1]; sizes = [int(s) for s in sys.argv[2].split(",")]; rounds = int(sys.argv[3])
targets = {}
os.environ["SPLITSPEC_HUGE_PAGES"] = "0"
t0 = time.perf_counter(); targets["mapped"] = load_target(model, dtype="float32", weights="lowbit"); t1 = time.perf_counter()
os.environ["SPLITSPEC_HUGE_PAGES"] = "1"
targets["huge"] = load_target(model, dtype="float32", weights="lowbit"); t2 = time.perf_counter()
print(f"load mapped {t1-t0:.2f} s, huge {t2-t1:.2f} s; held {hugepages.held_bytes()/1e9:.2f} GB", flush=True)
prefix = prefix_tokens(targets["mapped"].tokenizer, 128)
sessions = {}
for t, target in targets.items():
    s = target.session(); s.prefill(prefix); sessions[t] = (s, len(s.tokens))
with torch.inference_mode():
    for n in sizes:
        tree = balanced_tree(n - 1, 4)
        def step(t):
            s, L = sessions[t]
            def f():
                s.verify(tree); s.truncate(L)
            return f
        res = {t: [] for t in targets}
        for r in range(rounds):
            ms = interleaved_ms({t: step(t) for t in (targets if r % 2 else reversed(list(targets)))}, 5, 2)
            for t, v in ms.items(): res[t].append(v)
        a, b = statistics.median(res["mapped"]), statistics.median(res["huge"])
        print(f"n={n:3d} mapped {a:7.2f} ms  huge {b:7.2f} ms  {b/a:.3f}x  rounds {[round(y/x,3) for x,y in zip(res['mapped'],res['huge'])]}", flush=True)
