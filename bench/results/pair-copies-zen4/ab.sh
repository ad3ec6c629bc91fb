#!/bin/bash
# new (working tree) and old (HEAD) in turn, the same bench.single command; nothing else running
cmd="-m bench.single --model qwen2.5-coder-1.5b --drafters none,prompt-lookup,qwen2.5-coder-0.5b,qwen2.5-coder-0.5b+lookup --adaptive --limit 4 --max-new-tokens 128 --llama-bench= --llama-speculative="
for round in 1 2; do
  (cd /work/main && SPLITSPEC_ISA=$ISA .venv/bin/python $cmd --out /tmp/ab/new$round) > /tmp/ab/new$round.log 2>&1
  (cd /tmp/old && SPLITSPEC_ISA=$ISA /work/main/.venv/bin/python $cmd --out /tmp/ab/old$round) > /tmp/ab/old$round.log 2>&1
done
echo done > /tmp/ab/finished
