"""Client–server benchmark under simulated networks (MoA paper, Table 3): drafters on the client, target on the server.

A `splitspec serve` child hosts the target on loopback; netsim (the Toxiproxy-compatible proxy) puts a
network profile between it and this process, which runs the drafters (trained ones load the target too,
for the frozen parts they reuse). Per profile (``none`` = straight to the server) and prompt, every method
generates greedily, interleaved and rotated as in ``bench.single``:

* ``api``            the server decodes alone and streams tokens (one call)
* ``prompt-lookup``  training-free drafts, verified remotely
* ``independent``    the distilled small LM (no payload)
* ``eagle``          EAGLE-style: the server ships each new token's last hidden state (payload ``hidden``)
* ``moa-tliN``       MoA, static: payload ``lsa`` at fp16 (the server runs the LSA; TLI>0 adds the last N
                     layers' KV), EAGLE-2 tree B=4, D=5, 16 nodes, all of it verified every round
* ``moa-tliN-paper`` the same with the MoA paper's fixed tree (B=8, D=6, 62 nodes)
* ``moa-tliN-adaptive`` the adaptive policy (``client.loop.adaptive``, ``--mode draft``): tree size, depth and payload
                     per round, plain verification rounds while drafting loses
* ``<drafter>-auto`` the adaptive policy in ``--mode auto`` (the client's default): the server decodes stretches by
                     itself (server-side continuation) and drafting is tried between them, kept where it is faster
* ``<drafter>-stream`` ``--mode stream``: the server decodes everything after the prompt, streaming payloads the
                     drafter absorbs (what it costs over the API: the payloads; what it buys: offline text on a cut)
* ``<method>-serial`` the method without pipelined rounds: the client waits for each verdict before drafting the
                     next tree (every method over a link is pipelined by default, ``client.loop.decode``)
* ``<method>-unchained`` pipelined rounds that never send a tree before the verdict it assumes (chained rounds, the
                     default over a link, ``client.loop.ahead``: the server verifies it right after the round before)
* ``<method>-fail``  the method with ``on_reconnect="fail"`` (no heartbeat, no offline generation to fall back
                     on): every other method survives link drops as ``splitspec generate`` does by default,
                     so ``X`` beside ``X-fail`` is what that costs on a healthy link

``plain-local`` — plain decoding with the target in this process on the whole machine — is the
single-device reference ("recovers single-device speed"). Per run: tokens/s, τ, server calls per 100
tokens, server compute seconds per token, bytes per token up and down, payload bytes per token, time to
first token, the share of pipelined rounds whose guess held, the share of rounds already under way when their turn
came (chained), how busy each side was (the client drafting, the
server computing, as shares of the wall time), and whether the ids equal the API's (the target's greedy).

Run:  .venv/bin/python -m bench.network [--profiles none,5g,4g,lte,3g] [--limit K] [--methods a,b]
Writes network.json, network.md and network.png under --out (default bench/results).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from bench.common import (
    Timed,
    cell,
    drop_unusable,
    environment,
    finish,
    mark_differences,
    median,
    save_figure,
    share,
    skipped_note,
    start,
    table,
    times,
)
from bench.single import load_prompts
from client.build import Client, ClientOptions, Shared
from client.drafters import make_drafter
from client.loop.decode import generate
from client.verifiers import LocalVerifier
from netsim.device import DEVICES, CpuLimit
from netsim.profiles import PROFILES
from shared.engine.models import DEFAULT_MODEL, load_target
from shared.server_process import SINGLE_TURN, cpus_label, server_child, two_machines

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PROFILES = ["none", "5g", "4g", "lte", "3g"]
DEFAULT_METHODS = ["api", "prompt-lookup", "independent", "eagle", "eagle-auto", "medusa", "medusa-auto", "moa-tli0",
                   "moa-tli1", "moa-tli3", "moa-tli3-paper", "moa-tli3-adaptive", "moa-tli1-auto"]  # fmt: skip
MODES = {"-adaptive": "draft", "-auto": "auto", "-stream": "stream"}  # method suffix -> the adaptive policy's mode
REFERENCE = "api"
STATIC_TREE = (4, 5, 16)
PAPER_TREE = (8, 6, 62)


@dataclass
class Run(Timed):
    """One timed generation over a link (``profile``): the raw numbers that go into the JSON."""

    profile: str
    server_calls: int
    server_compute_s: float
    bytes_sent: int
    bytes_received: int
    payload_bytes: int
    prefill_payload_bytes: int
    ttft_s: float
    payload: str
    streamed_tokens: int = 0
    guesses: int = 0  # pipelined rounds that drafted ahead
    guesses_held: int = 0  # of which the next tree was ready when the verdict came
    client_busy_s: float = 0.0  # drafting: rounds' trees, ahead or not, and rehearsals
    chained_held: int = 0  # rounds under way, sent chained, when the verdict before them came (``-chained``)
    matches_reference: bool | None = None
    first_difference: int | None = None


def drafter_name(method: str) -> str:
    """The drafter a method runs: its name less the -fail, -serial, -unchained, -paper and policy-mode suffixes."""
    base = method.removesuffix("-fail").removesuffix("-serial").removesuffix("-unchained").removesuffix("-paper")
    return next((base.removesuffix(suffix) for suffix in MODES if base.endswith(suffix)), base)


class Method:
    """One way to generate against the server: a drafter (or the API), its payload, tree and policy, as a client
    (``client.build.Client``) with its own connection."""

    def __init__(self, name: str, target, address: str):
        self.name = name
        stem = name.removesuffix("-fail")
        mode = next((mode for suffix, mode in MODES.items() if stem.removesuffix("-serial").removesuffix(
            "-unchained").endswith(suffix)), None)  # fmt: skip
        base, tree, drafter = drafter_name(name), PAPER_TREE if "-paper" in name else STATIC_TREE, None
        trained = name != "api" and base not in ("prompt-lookup", "none")
        if name != "api":  # made here: a static tree's shape is the drafter's, not a pin on the policy
            drafter = make_drafter(base, target=target if trained else None, device=str(target.device),
                                   **({"width": tree[0], "depth": tree[1]} if trained else {}))  # fmt: skip
        fail = name.endswith("-fail")
        options = ClientOptions(server=address, probe_link=True, baseline="api" if name == "api" else None,
                                static=mode is None, mode=mode or "auto",
                                max_tree_nodes=None if mode else tree[2] if trained else 64,
                                pipeline=not stem.endswith("-serial"), chain=not stem.endswith("-unchained"),
                                on_reconnect="fail" if fail else None, heartbeat=not fail,
                                device=str(target.device))  # fmt: skip
        self.client = Client(options, Shared(target, target.tokenizer, target.fingerprint), drafter)
        self.drafter = self.client.drafter
        self.client.connect()  # the link probed before any run is timed

    def generate(self, prompt_ids: list[int], max_new_tokens: int):
        self.client.forget()  # a fresh policy per generation: what it learns is this generation's
        return self.client.generate(prompt_ids, max_new_tokens)

    def close(self) -> None:
        self.client.close()


def run_profile(profile: str, upstream: str, netsim, target, names: list[str], prompts, args) -> list[Run]:
    from netsim import simulated_link

    runs: list[Run] = []
    with contextlib.ExitStack() as stack:
        address = upstream
        if profile != "none":
            address = stack.enter_context(simulated_link(upstream, profile, netsim=netsim)).address
        methods = [Method(n, target, address) for n in names]
        for m in methods:
            stack.callback(m.close)
        bar = tqdm(total=len(prompts) * len(methods), desc=f"network {profile}", unit="run", file=sys.stderr)
        for k, prompt in enumerate(prompts):
            shift = k % len(methods)
            done = {}
            for m in methods[shift:] + methods[:shift]:
                bar.set_postfix_str(f"{prompt.dataset} {prompt.index} {m.name}")
                gen = m.generate(prompt.ids, args.max_new_tokens)
                s = gen.stats
                payload = gen.spec if m.drafter is not None else None
                run = Run(
                    prompt.dataset, prompt.index, m.name, s.new_tokens, round(s.wall_s, 4),
                    round(s.tokens_per_s, 3), round(s.acceptance_length, 4), s.rounds, profile, s.server_calls,
                    round(s.server_compute_s, 4), s.bytes_sent, s.bytes_received, s.payload_bytes,
                    s.prefill_payload_bytes, round(s.ttft_s, 4),
                    f"{payload.form}/{payload.precision}" if payload else "-", s.streamed_tokens, s.guesses,
                    s.guesses_held, round(s.draft_s + s.ahead_s + s.rehearse_s, 4), s.chained_held,
                )  # fmt: skip
                runs.append(run)
                done[m.name] = (run, gen.token_ids)
                bar.update()
            if REFERENCE in done:
                mark_differences(done, REFERENCE, f"{profile} {prompt.dataset} prompt {prompt.index}")
        bar.close()
    return runs


def plain_local(target, prompts, args) -> list[Run]:
    """Plain decoding in-process on the whole machine: the single-device reference."""
    torch.set_num_threads(args.server_threads + args.client_threads)
    runs = []
    try:
        for prompt in tqdm(prompts, desc="plain-local", unit="run", file=sys.stderr):
            gen = generate(LocalVerifier(target), make_drafter("none"), prompt.ids, args.max_new_tokens)
            s = gen.stats
            runs.append(Run(prompt.dataset, prompt.index, "plain-local", s.new_tokens, round(s.wall_s, 4),
                            round(s.tokens_per_s, 3), 1.0, s.rounds, "local", 0, round(s.server_compute_s, 4),
                            0, 0, 0, 0, round(s.ttft_s, 4), "-"))  # fmt: skip
    finally:
        torch.set_num_threads(args.client_threads)
    return runs


def summarize(runs: list[Run]) -> dict[str, dict[str, dict]]:
    """{profile: {method: medians over prompts}}."""
    out: dict[str, dict[str, dict]] = {}
    for r in runs:
        out.setdefault(r.profile, {}).setdefault(r.method, {})
    for profile, methods in out.items():
        for method in methods:
            mine = [r for r in runs if r.profile == profile and r.method == method]
            tokens = [max(r.tokens, 1) for r in mine]
            methods[method] = {
                "prompts": len(mine),
                "median_tokens_per_s": median([r.tokens_per_s for r in mine]),
                "mean_acceptance_length": round(statistics.fmean(r.acceptance_length for r in mine), 3),
                "calls_per_100_tokens": median([100 * r.server_calls / t for r, t in zip(mine, tokens, strict=True)]),
                "server_s_per_token": median([r.server_compute_s / t for r, t in zip(mine, tokens, strict=True)]),
                "bytes_up_per_token": median([r.bytes_sent / t for r, t in zip(mine, tokens, strict=True)]),
                "bytes_down_per_token": median([r.bytes_received / t for r, t in zip(mine, tokens, strict=True)]),
                "payload_bytes_per_token": median(  # the rounds' payloads; the prompt's is prefill_payload_bytes
                    [(r.payload_bytes - r.prefill_payload_bytes) / t for r, t in zip(mine, tokens, strict=True)]
                ),
                "prefill_payload_bytes": median([r.prefill_payload_bytes for r in mine]),
                "median_ttft_s": median([r.ttft_s for r in mine]),
                "streamed_share": round(sum(r.streamed_tokens for r in mine) / sum(tokens), 3),
                "held_share": round(sum(r.guesses_held for r in mine) / sum(r.guesses for r in mine), 3)
                if any(r.guesses for r in mine) else None,
                "chained_share": round(sum(r.chained_held for r in mine) / sum(r.rounds for r in mine), 3)
                if any(r.chained_held for r in mine) else None,
                "client_busy": median([r.client_busy_s / r.wall_s for r in mine if r.wall_s > 0]),
                "server_busy": median([r.server_compute_s / r.wall_s for r in mine if r.wall_s > 0]),
                "mismatches": sum(r.matches_reference is False for r in mine),
            }
    return out


def against_api(runs: list[Run]) -> dict[str, dict[str, dict[str, dict]]]:
    """{profile: {dataset: {method: ...}}}: each method beside the API on the same prompts over the same link — the
    medians over prompts of its tok/s and server compute per token, each over the API's on that prompt."""
    api = {(r.profile, r.dataset, r.prompt): r for r in runs if r.method == REFERENCE}
    out: dict[str, dict[str, dict[str, dict]]] = {}
    for r in runs:
        if r.method != REFERENCE and (r.profile, r.dataset, r.prompt) in api:
            out.setdefault(r.profile, {}).setdefault(r.dataset, {}).setdefault(r.method, {"runs": []})["runs"].append(r)
    for datasets in out.values():
        for methods in datasets.values():
            for method, entry in methods.items():
                mine = entry.pop("runs")
                base = [api[(r.profile, r.dataset, r.prompt)] for r in mine]
                per_token = [r.server_compute_s / max(r.tokens, 1) for r in mine]
                base_per_token = [b.server_compute_s / max(b.tokens, 1) for b in base]
                methods[method] = {
                    "prompts": len(mine),
                    "median_tokens_per_s": median([r.tokens_per_s for r in mine]),
                    "api_tokens_per_s": median([b.tokens_per_s for b in base]),
                    "speed_vs_api": median([r.tokens_per_s / b.tokens_per_s for r, b in zip(mine, base, strict=True)]),
                    "server_s_per_token": median(per_token),
                    "api_server_s_per_token": median(base_per_token),
                    "server_vs_api": median([m / b for m, b in zip(per_token, base_per_token, strict=True) if b > 0]),
                    "streamed_share": round(sum(r.streamed_tokens for r in mine) / sum(max(r.tokens, 1) for r in mine),
                                            3),  # fmt: skip
                }
    return out


def markdown_against_api(compared: dict[str, dict[str, dict[str, dict]]]) -> str:
    columns = ["profile", "dataset", "method", "tok/s", "API tok/s", "× API tok/s", "server ms/tok",
               "API server ms/tok", "× API server", "streamed"]  # fmt: skip
    rows = [
        [profile, dataset, m, cell(s["median_tokens_per_s"], ".2f"), cell(s["api_tokens_per_s"], ".2f"),
         times(s["speed_vs_api"]), cell(1000 * s["server_s_per_token"], ".1f"),
         cell(1000 * s["api_server_s_per_token"], ".1f"), times(s["server_vs_api"]), share(s["streamed_share"] or None)]
        for profile, datasets in compared.items() for dataset, methods in datasets.items() for m, s in methods.items()
    ]  # fmt: skip
    return table(columns, rows, left=3)


def markdown(summary: dict[str, dict[str, dict]]) -> str:
    columns = ["profile", "method", "tok/s", "τ", "calls/100 tok", "server ms/tok", "B/tok up", "B/tok down",
               "payload B/tok", "prefill payload KB", "TTFT s", "streamed", "guess held", "chained", "client busy",
               "server busy", "≠ api"]  # fmt: skip
    rows = []
    for profile, methods in summary.items():
        for m, s in methods.items():
            ms = None if s["server_s_per_token"] is None else 1000 * s["server_s_per_token"]
            prefill_kb = None if s["prefill_payload_bytes"] is None else s["prefill_payload_bytes"] / 1024
            rows.append([
                profile, m, cell(s["median_tokens_per_s"], ".2f"), cell(s["mean_acceptance_length"], ".2f"),
                cell(s["calls_per_100_tokens"], ".1f"), cell(ms, ".1f"), cell(s["bytes_up_per_token"], ".0f"),
                cell(s["bytes_down_per_token"], ".0f"), cell(s["payload_bytes_per_token"], ".0f"),
                cell(prefill_kb, ".0f"), cell(s["median_ttft_s"], ".2f"), share(s["streamed_share"] or None),
                share(s.get("held_share")), share(s.get("chained_share")), share(s.get("client_busy")),
                share(s.get("server_busy")),
                "–" if m in (REFERENCE, "plain-local") else str(s["mismatches"]),
            ])  # fmt: skip
    return table(columns, rows, left=2)


def plot(summary: dict[str, dict[str, dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profiles = [p for p in summary if p != "local"]
    methods = list(dict.fromkeys(m for p in profiles for m in summary[p]))
    fig, ax = plt.subplots(figsize=(13, 5))
    width = 0.8 / max(1, len(methods))
    cmap = plt.get_cmap("tab10")
    for j, m in enumerate(methods):
        xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(profiles))]
        ys = [(summary[p].get(m) or {}).get("median_tokens_per_s") or 0.0 for p in profiles]
        ax.bar(xs, ys, width, label=m, color=cmap(j % 10))
    local = (summary.get("local", {}).get("plain-local") or {}).get("median_tokens_per_s")
    if local:
        ax.axhline(local, color="black", ls="--", lw=1, label=f"plain, single device ({local:.1f})")
    ax.set_xticks(range(len(profiles)), profiles)
    ax.set_ylabel("tokens/s (median over prompts)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, ncol=3)
    ax.set_title(title, fontsize=10)
    save_figure(fig, path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profiles", default=",".join(DEFAULT_PROFILES), help="comma list of netsim profiles and/or none")
    p.add_argument(
        "--methods", default=",".join(DEFAULT_METHODS), help=f"comma list (default {','.join(DEFAULT_METHODS)})"
    )
    p.add_argument("--limit", type=int, default=2, help="first K prompts of each dataset (default 2)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="token budget per generation (default 128)")
    p.add_argument("--server-threads", type=int, default=1, help="torch threads of the server child (default 1)")
    p.add_argument("--client-threads", type=int, default=1, help="torch threads here (default 1)")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"the target (default {DEFAULT_MODEL})")
    p.add_argument("--device", default="cpu", help="the target's device, served and here; model drafters' too "
                   "(default cpu)")
    p.add_argument("--dtype", default="auto", help="the target's dtype, served and here (default auto, as `serve`)")
    p.add_argument("--weights", default="auto", help="the target's weights, served and here (default auto: low-bit "
                   "where lossless; native with --dtype float32 for the check against transformers)")
    p.add_argument("--client-device", help="where the client's drafters (and the target pieces they reuse, and "
                   "plain-local) run, when not where the server's target does: an edge beside a GPU server is "
                   "--device cuda --client-device cpu (its dtype and weights then this CPU's own: auto); default "
                   "--device")  # fmt: skip
    p.add_argument("--edge", choices=list(DEVICES), help="the client's CPU held to an edge device's share of one core "
                   "(netsim.device) while it drafts; default: the client's threads unheld")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results", help="output folder")
    args = p.parse_args(argv)
    args.profiles = [x.strip() for x in args.profiles.split(",") if x.strip()]
    args.methods = [x.strip() for x in args.methods.split(",") if x.strip()]
    bad = [x for x in args.profiles if x != "none" and x not in PROFILES]
    if bad:
        p.error(f"unknown profile(s) {bad}; expected none or {', '.join(PROFILES)}")
    if args.limit < 1 or args.max_new_tokens < 1:
        p.error("--limit and --max-new-tokens must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    from netsim import Netsim

    args = parse_args(argv)
    start(args.client_threads)
    apart = args.client_device not in (None, args.device)  # drafts only: the client's precision is its own
    target = load_target(args.model, device=args.client_device or args.device, dtype="auto" if apart else args.dtype,
                         weights="auto" if apart else args.weights)  # fmt: skip
    dtype = str(target.dtype).removeprefix("torch.")
    prompts = load_prompts(target.tokenizer, args.limit)
    args.methods, skipped = drop_unusable(args.methods, target, lambda m: None if m == REFERENCE else drafter_name(m))
    if not args.methods:
        print(f"error: no method left to run on {args.model}", file=sys.stderr)
        return 2
    runs = plain_local(target, prompts, args)
    cpus = two_machines(args.server_threads, args.client_threads)  # after plain-local, which runs on both shares
    torch.set_num_threads(args.client_threads)
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        serve_args = ["--model", args.model, "--threads", str(args.server_threads), "--dtype", args.dtype,
                      "--weights", args.weights, "--device", args.device, *SINGLE_TURN]  # fmt: skip
        upstream = stack.enter_context(server_child(serve_args, Path(tmp), cpus=cpus and cpus[0]))
        netsim = stack.enter_context(Netsim.start_own()) if set(args.profiles) - {"none"} else None
        edge = args.edge and stack.enter_context(CpuLimit(os.getpid(), DEVICES[args.edge].cpu_share))  # children apart
        for profile in args.profiles:
            runs += run_profile(profile, upstream, netsim, target, args.methods, prompts, args)
    summary = summarize(runs)
    env = {
        **environment(args.client_threads, args.device),
        "server_threads": args.server_threads,
        "cpus": cpus_label(cpus),
        "edge": edge and {"profile": args.edge, "cpu_share": edge.share, "how": edge.how},
    }
    compared = against_api(runs)
    report = markdown(summary)
    if compared:
        report += ("\n\nEach method beside the API on the same prompts, by dataset (medians over prompts of the "
                  "per-prompt ratios; server compute includes the prompt's prefill):\n\n")
        report += markdown_against_api(compared)
    counts = {d: sum(p.dataset == d for p in prompts) for d in ("mt-bench", "humaneval")}
    settings = {
        "profiles": args.profiles, "methods": args.methods, "skipped": skipped, "max_new_tokens": args.max_new_tokens,
        "prompts": counts,
        "static_tree": STATIC_TREE, "paper_tree": PAPER_TREE,
        "profiles_set": {p: asdict(PROFILES[p]) for p in args.profiles if p in PROFILES},
    }  # fmt: skip
    result = {"environment": env, "settings": settings, "summary": summary, "against_api": compared,
              "runs": [asdict(r) for r in runs]}  # fmt: skip
    held = f" held to {edge.share:g} of a core ({args.edge}: {edge.how})" if edge else ""
    header = (
        f"# Client–server benchmark under simulated networks\n\n`{env['command']}`\n\n{env['date']}, "
        f"{args.model} ({args.dtype if apart else dtype}, weights {args.weights}, {args.device}): server child "
        f"{args.server_threads} "
        f"thread(s){f'; client on {args.client_device} ({dtype}, its own weights)' if apart else ''}, "
        f"client {args.client_threads}{held}, "
        f"on {env['cpu_count']} CPUs ({env['cpu']}; {env['cpus']}); {counts['mt-bench']} MT-Bench + "
        f"{counts['humaneval']} HumanEval "
        f"prompts, greedy, ≤{args.max_new_tokens} new tokens; medians over prompts (τ: mean). plain-local: the target "
        f"in-process on {args.server_threads + args.client_threads} threads, no network.\n\n"
        + skipped_note(skipped)
    )
    plot(summary, args.out / "network.png", f"{args.model}: tokens/s by network profile (client and server on one CPU)")
    return finish(args.out, "network", result, header + report, report)


if __name__ == "__main__":
    sys.exit(main())
