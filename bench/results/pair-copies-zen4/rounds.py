"""Diagnostic: per round of prompt lookup on chat, nodes sent, accepted, the verification's seconds."""
import statistics as st
import sys
import time
from collections import defaultdict

from bench import single
from bench.common import start
from client.verifiers import LocalVerifier
from shared.engine.models import load_target  # noqa

limit = int(sys.argv[1]) if len(sys.argv) > 1 else 4
dataset = sys.argv[2] if len(sys.argv) > 2 else "mt-bench"
drafters = sys.argv[3] if len(sys.argv) > 3 else "none,prompt-lookup"
args = single.parse_args(["--model", "qwen2.5-coder-1.5b", "--drafters", drafters, "--adaptive",
                          "--limit", str(limit), "--max-new-tokens", "128", "--llama-bench=", "--llama-speculative="])
start(args.threads)
lt = single.load_target
target = lt(args.model, device=args.device, dtype=args.dtype, graphs=args.cuda_graphs)
prompts = [p for p in single.load_prompts(target.tokenizer, args.limit) if p.dataset == dataset]
methods, _ = single.make_methods(args.drafters, target, args)
for m in methods:
    m.adaptive = True
log = []
orig = LocalVerifier.verify


def verify(self, tree, timeout_s=None, **kw):
    t = time.perf_counter()
    v = orig(self, tree, timeout_s, **kw)
    kind = "c" if tree.scores is None and len(tree) else ("m" if len(tree) else "p")
    log.append((kind + str(len(tree)), len(v.accepted), time.perf_counter() - t))
    return v


LocalVerifier.verify = verify
warm = single.encode_prompt(target.tokenizer, single.WARMUP_PROMPT, chat=True)
for m in methods:
    single.run_method(target, m, warm, 8)
for rep in range(2):
    for k, p in enumerate(prompts):
        for m in methods:
            log.clear()
            t = time.perf_counter()
            g = single.run_method(target, m, p.ids, 128, seed=k)
            wall = time.perf_counter() - t
            by = defaultdict(list)
            for n, a, s in log:
                by[n].append((a, s))
            desc = " ".join(f"{n}:{len(v)}r/{sum(a for a, _ in v)}acc/{st.median(s for _, s in v)*1e3:.1f}ms"
                            for n, v in sorted(by.items()))
            print(f"rep{rep} p{k} {m.name:14s} wall {wall:.2f}s toks {g.stats.new_tokens} rounds {len(log)} | {desc}",
                  flush=True)
