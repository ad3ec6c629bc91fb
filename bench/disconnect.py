"""The link cut for good mid-generation (MoA paper, Table 4): who keeps writing, and how well.

A `splitspec serve` child hosts the target; netsim puts a network profile (default 5g) between it and
this process. Per HumanEval prompt, cut point N and method, a generation starts through the link and,
once the server has delivered N new tokens (at the first round boundary from there; N=0: right after
the prefill's first token), the link is cut *silently* — every byte dropped both ways, nothing closed,
as when a radio link fades — and never restored. The API client stops dead; a speculative client
notices the dead link by its heartbeat or deadline (``client.loop.decode``) and finishes the generation on its own
(``client.loop.offline.offline_token``: greedy, the drafter alone or with the target's last N layers, TLI).

Per run: the moment of the switch to offline generation after the cut (against the issue's bound
2 x RTT + 100 ms, RTT = the profile's), offline tokens/s, the *agreement* of the offline continuation
with the target's own greedy continuation from the same point (token accuracy over the next
``--window`` tokens; where the target stops earlier, over what it wrote; an offline run that stops
early scores its missing tokens as wrong), the run of leading tokens that agree, whether the output
kept every verified token and every offline token exactly once, and HumanEval pass@1 of the whole
reply (``bench.humaneval``: the problem's tests in a subprocess with a timeout). The uninterrupted
target's pass@1 at the same token budget is the ceiling (row ``target``).

Run:  .venv/bin/python -m bench.disconnect [--limit K] [--cuts 0,25,50,100] [--methods a,b] [--profile 5g]
Writes disconnect.json, disconnect.md and disconnect.png under --out (default bench/results).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from bench.common import (
    cell,
    drop_unusable,
    environment,
    finish,
    median,
    save_figure,
    served_target,
    skipped_note,
    start,
    table,
)
from bench.humaneval import passes
from bench.network import STATIC_TREE
from bench.single import load_prompts
from client.drafters import ALIASES, DRAFTERS, make_drafter
from client.loop.decode import Settings, generate
from client.loop.offline import Backoff, Resilience
from client.net.api import api_complete
from client.net.remote import RemoteVerifier
from client.training.datasets import humaneval_problems
from client.verifiers import LocalVerifier, Pending, first_spec
from netsim.profiles import PROFILES
from shared.acceptance import SamplingParams
from shared.engine.models import DEFAULT_MODEL
from shared.server_process import SINGLE_TURN, cpus_label, server_child, two_machines

REPO = Path(__file__).resolve().parent.parent
DEFAULT_METHODS = ["api", "independent", "eagle", "medusa", "moa-tli0", "moa-tli1", "moa-tli3"]
DEFAULT_CUTS = [0, 25, 50, 100]
SESSION_TTL_S = 20
TAU_SLACK = STATIC_TREE[1] + 1  # a round may overshoot the cut point by up to depth + 1 tokens


@dataclass
class Run:
    prompt: int
    task_id: str
    cut: int  # the requested cut point N
    method: str
    cut_at: int | None  # tokens verified when the link went (None: the generation ended first)
    tokens: int
    offline_tokens: int
    switch_ms: float | None
    bound_ms: float
    offline_tokens_per_s: float | None
    agreement: float | None
    agreeing_run: int | None  # leading offline tokens equal to the target's
    next_token_accuracy: float | None  # teacher-forced: the offline drafter's next token, given the true history
    intact: bool  # every verified token kept, every offline token present once
    passed: bool


class _Cut(Exception):
    """The API's stream is dead: nothing more will come."""


class CutAfter:
    """Wraps a RemoteVerifier so the link is cut silently before the first Verify after ``n`` tokens — a chained
    round's (``verify_after``) too, whose verified tokens count as a plain round's do."""

    def __init__(self, verifier: RemoteVerifier, link, n: int):
        self.verifier, self.link, self.n = verifier, link, n
        self.produced, self.cut_time = 0, None
        self._open, self._verify, self._verify_after = verifier.open, verifier.verify, verifier.verify_after
        verifier.open, verifier.verify, verifier.verify_after = self.open, self.verify, self.verify_after

    @property
    def cut_at(self) -> int | None:
        """Tokens the server verified, once the link is cut: a reply already on its way when it was cut counts."""
        return self.produced if self.cut_time is not None else None

    def open(self, *args, **kwargs):
        result = self._open(*args, **kwargs)
        self.produced += len(result.new_tokens)
        return result

    def verify(self, tree, **kwargs):
        self._maybe_cut()
        result = self._verify(tree, **kwargs)
        self.produced += len(result.new_tokens)
        return result

    def verify_after(self, length, assumed, tree, **kwargs) -> Pending:
        self._maybe_cut()
        pending = self._verify_after(length, assumed, tree, **kwargs)

        def verdict():
            result = pending.verdict()
            self.produced += len(result.new_tokens)
            return result

        return Pending(verdict, pending.drop, pending.done)

    def _maybe_cut(self) -> None:
        if self.cut_time is None and self.produced >= self.n:
            self.link.cut(silent=True)
            self.cut_time = time.perf_counter()


def agreement(out: list[int], reference: list[int], start: int, window: int) -> tuple[float | None, int | None]:
    """(token accuracy of ``out[start:start+window]`` against ``reference``, leading agreeing tokens)."""
    ref = reference[start : start + window]
    if not ref:
        return None, None
    mine = out[start : start + len(ref)]
    same = [a == b for a, b in zip(mine, ref, strict=False)]
    run = next((i for i, s in enumerate(same) if not s), len(same))
    return sum(same) / len(ref), run


def next_token_accuracy(drafter, target, prompt_ids, reference, cut_at, window) -> float | None:
    """The drafter offline, but fed the target's own tokens: how often its next token is the target's.

    Free-running agreement compounds: one early miss misaligns the rest. This asks the per-step question
    through the same interface (``propose(1, 1)``, then ``absorb`` the true token, no features), from the
    state the cut leaves: every token up to ``cut_at`` verified, the last one's features not yet known.
    """
    truth = reference[cut_at : cut_at + window]
    if not truth:
        return None
    verifier = LocalVerifier(target)
    opened = verifier.open(prompt_ids + reference[: cut_at - 1], SamplingParams(),
                           spec=first_spec(verifier, drafter.payload_specs()))  # fmt: skip
    drafter.begin(prompt_ids + reference[:cut_at], opened.features)
    hits = 0
    for token in truth:
        tree = drafter.propose(1, 1)
        hits += bool(tree.tokens) and tree.tokens[0] == token
        drafter.absorb([token])
    return hits / len(truth)


def make_drafters(names: list[str], target) -> dict:
    """{method: (drafter, the model that writes during the cut or None)}; ``DRAFTER:MODEL`` has MODEL write
    (``Resilience.offline``: the 0.5B beside MoA), ``DRAFTER`` alone writes itself."""
    width, depth, _ = STATIC_TREE
    out = {}
    for name in names:
        if name != "api":
            drafter, _, writer = name.partition(":")
            out[name] = (make_drafter(drafter, target=target, width=width, depth=depth),
                         make_drafter(writer, target=target) if writer else None)  # fmt: skip
    return out


def one_run(name, drafters, upstream, netsim, target, prompt, problem, n, reference, args) -> Run:
    from netsim import simulated_link

    drafter, writer = drafters or (None, None)
    profile = PROFILES[args.profile]
    bound_ms = 2 * profile.rtt_ms + 100
    limit = n + args.window + TAU_SLACK
    with simulated_link(upstream, profile, netsim=netsim) as link:
        verifier = RemoteVerifier(link.address, fingerprint=target.fingerprint, drafter=drafter)
        try:
            verifier.connection.probe_link()
            if drafter is None:
                return api_run(verifier, link, target, prompt, problem, n, limit, reference, bound_ms, args)
            cutter = CutAfter(verifier, link, n)
            gen = generate(
                verifier, drafter, prompt.ids, limit,
                Settings(
                    max_tree_nodes=STATIC_TREE[2],
                    resilience=Resilience(settle_wait_s=0.0, backoff=Backoff(base_s=0.05, cap_s=1.0, seed=n),
                                      offline_cap=0.0, offline=writer),
                ),
            )  # fmt: skip
        finally:
            verifier.shutdown()
    s, out = gen.stats, gen.token_ids
    cut_at = cutter.cut_at
    switch = 1000 * (s.switched_at[0] - cutter.cut_time) if cut_at is not None and s.switched_at else None
    agree, run = agreement(out, reference, cut_at, args.window) if cut_at is not None else (None, None)
    verified_kept = cut_at is None or out[:cut_at] == reference[:cut_at]
    once = cut_at is None or len(out) == cut_at + s.offline_tokens or gen.finish_reason == "stop"
    text = target.tokenizer.decode(out, skip_special_tokens=True)
    accuracy = None
    if cut_at is not None:
        accuracy = next_token_accuracy(writer or drafter, target, prompt.ids, reference, cut_at, args.window)
    return Run(prompt.index, problem["task_id"], n, name, cut_at, len(out), s.offline_tokens,
               None if switch is None else round(switch, 1), bound_ms,
               round(s.offline_tokens_per_s, 2) if s.offline_tokens else None,
               None if agree is None else round(agree, 4), run, None if accuracy is None else round(accuracy, 4),
               verified_kept and once, passes(problem, text, args.test_timeout))  # fmt: skip


def api_run(verifier, link, target, prompt, problem, n, limit, reference, bound_ms, args) -> Run:
    """The API streams tokens; after ``n`` (at least the first) the link goes and the stream is dead."""
    out: list[int] = []

    def on_update(tokens: list[int], verified: list[bool]) -> None:
        out[:] = tokens
        if len(out) >= max(n, 1):
            link.cut(silent=True)
            raise _Cut

    with contextlib.suppress(_Cut):
        api_complete(verifier, prompt.ids, limit, on_update=on_update)
    cut_at = len(out) if len(out) < limit and not set(out) & set(verifier.eos_token_ids) else None
    agree, run = agreement(out, reference, cut_at, args.window) if cut_at is not None else (None, None)
    text = target.tokenizer.decode(out, skip_special_tokens=True)
    return Run(prompt.index, problem["task_id"], n, "api", cut_at, len(out), 0, None, bound_ms, 0.0 if cut_at else None,
               agree, run, 0.0 if cut_at else None, out == reference[: len(out)],
               passes(problem, text, args.test_timeout))  # fmt: skip


def summarize(runs: list[Run], ceiling: dict[int, float]) -> dict[str, dict[str, dict]]:
    """{method: {N: aggregates}} plus the uninterrupted target's pass@1 per N."""
    out: dict[str, dict[str, dict]] = {}
    for method in dict.fromkeys(r.method for r in runs):
        for n in sorted({r.cut for r in runs}):
            mine = [r for r in runs if r.method == method and r.cut == n]
            cut = [r for r in mine if r.cut_at is not None]
            switches = [r.switch_ms for r in cut if r.switch_ms is not None]
            agreements = [r.agreement for r in cut if r.agreement is not None]
            accuracies = [r.next_token_accuracy for r in cut if r.next_token_accuracy is not None]
            out.setdefault(method, {})[str(n)] = {
                "runs": len(mine),
                "cut_runs": len(cut),
                "median_cut_at": median([r.cut_at for r in cut]),
                "median_offline_tokens_per_s": median([r.offline_tokens_per_s or 0.0 for r in cut]),
                "mean_agreement": round(statistics.fmean(agreements), 4) if agreements else None,
                "median_agreeing_run": median([r.agreeing_run for r in cut if r.agreeing_run is not None]),
                "mean_next_token_accuracy": round(statistics.fmean(accuracies), 4) if accuracies else None,
                "median_switch_ms": median(switches),
                "max_switch_ms": max(switches) if switches else None,
                "within_bound": sum(r.switch_ms <= r.bound_ms for r in cut if r.switch_ms is not None),
                "bound_ms": mine[0].bound_ms if mine else None,
                "intact": sum(r.intact for r in mine),
                "pass_at_1": round(sum(r.passed for r in mine) / len(mine), 4) if mine else None,
            }
    out["target"] = {str(n): {"runs": None, "pass_at_1": p} for n, p in ceiling.items()}
    return out


def markdown(summary: dict[str, dict[str, dict]]) -> str:
    columns = ["method", "N", "cut at", "offline tok/s", "agreement", "agreeing run", "next-token acc.",
               "switch ms (median / max)", "≤ 2·RTT+100 ms", "intact", "pass@1"]  # fmt: skip
    rows = []
    for method, cuts in summary.items():
        for n, s in cuts.items():
            if method == "target":
                rows.append(["target (uninterrupted)", n, *["–"] * 8, cell(s["pass_at_1"], ".2f")])
                continue
            switch = "–" if s["median_switch_ms"] is None else f"{s['median_switch_ms']:.0f} / {s['max_switch_ms']:.0f}"
            rows.append([
                method, n, cell(s["median_cut_at"], ".0f"), cell(s["median_offline_tokens_per_s"], ".1f"),
                cell(s["mean_agreement"], ".3f"), cell(s["median_agreeing_run"], ".0f"),
                cell(s["mean_next_token_accuracy"], ".3f"), switch,
                "–" if method == "api" else f"{s['within_bound']}/{s['cut_runs']}",
                f"{s['intact']}/{s['runs']}", cell(s["pass_at_1"], ".2f"),
            ])  # fmt: skip
    return table(columns, rows)


def plot(summary: dict[str, dict[str, dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [m for m in summary if m != "target"]
    panels = [
        ("mean_agreement", "agreement with the target (free-running)"),
        ("mean_next_token_accuracy", "next-token accuracy (teacher-forced)"),
        ("pass_at_1", "HumanEval pass@1"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 4.5))
    for ax, (key, label) in zip(axes, panels, strict=True):
        for m in methods:
            cuts = list(summary[m])
            ax.plot([int(n) for n in cuts], [summary[m][n][key] or 0.0 for n in cuts], marker="o", label=m)
        ax.set(xlabel="link cut after N new tokens", ylabel=label)
        ax.grid(alpha=0.3)
    ceiling = summary.get("target", {})
    axes[-1].plot([int(n) for n in ceiling], [v["pass_at_1"] for v in ceiling.values()], "k--", label="target, uncut")
    axes[-1].legend(fontsize=8)
    save_figure(fig, path, title)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--methods", default=",".join(DEFAULT_METHODS),
        help=f"comma list (default {','.join(DEFAULT_METHODS)}); DRAFTER:MODEL drafts with DRAFTER and has MODEL "
             "write after the cut (e.g. moa-tli1:qwen2.5-coder-0.5b)",
    )
    p.add_argument(
        "--cuts", default=",".join(map(str, DEFAULT_CUTS)), help="new tokens before the cut (default 0,25,50,100)"
    )
    p.add_argument("--limit", type=int, default=6, help="first K HumanEval problems (default 6)")
    p.add_argument("--window", type=int, default=128, help="offline tokens compared with the target's (default 128)")
    p.add_argument("--profile", default="5g", help="netsim profile of the link before the cut (default 5g)")
    p.add_argument("--test-timeout", type=float, default=10.0, help="seconds per HumanEval program (default 10)")
    p.add_argument("--server-threads", type=int, default=1, help="torch threads of the server child (default 1)")
    p.add_argument("--client-threads", type=int, default=1, help="torch threads here (default 1)")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"the target (default {DEFAULT_MODEL})")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results", help="output folder")
    args = p.parse_args(argv)
    args.methods = [x.strip() for x in args.methods.split(",") if x.strip()]
    mute = [m for m in args.methods if ALIASES.get(m, m) in DRAFTERS]  # no ":MODEL" writer
    if mute:  # once its lookups miss it offers nothing offline: the run would wait out Resilience.max_offline_s
        p.error(f"{', '.join(mute)} cannot write after the cut on its own; give it a model that writes, e.g. "
                f"{mute[0]}:qwen2.5-coder-0.5b")
    try:
        args.cuts = sorted({int(x) for x in args.cuts.split(",") if x.strip()})
    except ValueError:
        p.error(f"--cuts must be comma-separated integers, got {args.cuts!r}")
    if args.profile not in PROFILES or PROFILES[args.profile].offline or PROFILES[args.profile].flaky:
        p.error(f"--profile must be a steady netsim profile (e.g. 5g, 4g, lte, 3g), got {args.profile!r}")
    if args.limit < 1 or args.window < 1 or any(n < 0 for n in args.cuts):
        p.error("--limit and --window must be >= 1 and cut points >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    from netsim import Netsim

    args = parse_args(argv)
    start(args.client_threads)
    target, dtype = served_target(args.model)
    problems = humaneval_problems()
    prompts = [p for p in load_prompts(target.tokenizer, args.limit) if p.dataset == "humaneval"]
    args.methods, skipped = drop_unusable(args.methods, target, lambda m: None if m == "api" else m.partition(":")[0])
    if not args.methods:
        print(f"error: no method left to run on {args.model}", file=sys.stderr)
        return 2
    drafters = make_drafters(args.methods, target)
    longest = max(args.cuts) + args.window + TAU_SLACK
    references, ceiling_runs = {}, {n: [] for n in args.cuts}
    for prompt in tqdm(prompts, desc="target greedy", unit="prompt", file=sys.stderr):
        ids = generate(LocalVerifier(target), make_drafter("none"), prompt.ids, longest).token_ids
        references[prompt.index] = ids
        for n in args.cuts:  # the uninterrupted target at each run's token budget: the pass@1 ceiling
            text = target.tokenizer.decode(ids[: n + args.window + TAU_SLACK], skip_special_tokens=True)
            ceiling_runs[n].append(passes(problems[prompt.index], text, args.test_timeout))
    ceiling = {n: round(sum(v) / len(v), 4) for n, v in ceiling_runs.items()}
    runs: list[Run] = []
    cpus = two_machines(args.server_threads, args.client_threads)  # the server and the device on their own cores
    torch.set_num_threads(args.client_threads)
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        # every run leaves a session behind the dead link: a short TTL frees it while the next runs go on
        serve = ["--model", args.model, "--threads", str(args.server_threads), "--session-ttl", str(SESSION_TTL_S),
                 "--max-sessions", "32", *SINGLE_TURN]  # fmt: skip
        upstream = stack.enter_context(server_child(serve, Path(tmp), cpus=cpus and cpus[0]))
        netsim = stack.enter_context(Netsim.start_own())
        bar = tqdm(total=len(prompts) * len(args.cuts) * len(args.methods), desc="disconnect", unit="run",
                   file=sys.stderr)  # fmt: skip
        k = 0
        for prompt in prompts:
            problem = problems[prompt.index]
            for n in args.cuts:
                shift = k % len(args.methods)
                k += 1
                for name in args.methods[shift:] + args.methods[:shift]:
                    bar.set_postfix_str(f"{problem['task_id']} N={n} {name}")
                    run = one_run(name, drafters.get(name), upstream, netsim, target, prompt, problem, n,
                                  references[prompt.index], args)  # fmt: skip
                    runs.append(run)
                    if not run.intact:
                        tqdm.write(
                            f"WARNING: {name} N={n} {problem['task_id']}: tokens lost or duplicated", file=sys.stderr
                        )
                    bar.update()
        bar.close()
    summary = summarize(runs, ceiling)
    env = {**environment(args.client_threads), "server_threads": args.server_threads, "cpus": cpus_label(cpus)}
    settings = {
        "methods": args.methods, "skipped": skipped, "cuts": args.cuts, "window": args.window,
        "profile": asdict(PROFILES[args.profile]),
        "problems": [p["task_id"] for p in problems[: args.limit]], "tree": STATIC_TREE, "payload": "lsa/fp16",
    }  # fmt: skip
    result = {"environment": env, "settings": settings, "summary": summary, "runs": [asdict(r) for r in runs]}
    report = markdown(summary)
    header = (
        f"# The link cut for good mid-generation\n\n`{env['command']}`\n\n{env['date']}, {args.model} ({dtype}, cpu): "
        f"server child {args.server_threads} thread(s), client {args.client_threads}, on {env['cpu_count']} CPUs "
        f"({env['cpus']}); "
        f"first {len(prompts)} HumanEval problems, greedy, link {args.profile} cut silently after N new tokens and "
        f"never restored; agreement over the next {args.window} tokens against the target's own greedy "
        f"continuation; pass@1 at {args.window + TAU_SLACK} + N tokens; medians over problems (agreement: mean).\n\n"
        + skipped_note(skipped)
    )
    plot(summary, args.out / "disconnect.png", f"{args.model}: the link cut for good after N tokens ({args.profile})")
    return finish(args.out, "disconnect", result, header + report, report)


if __name__ == "__main__":
    sys.exit(main())
