"""Conversations across Ray Serve replicas: does a next turn find its replica's prefix cache? (``make bench-chat-ray``)

``serve --ray`` routes a call by the route key of its prompt's first 64 tokens (``shared.channel.route_key``), which
every turn of a conversation shares, so each turn should land on the replica that holds the conversation's prefix.
Here 2 replicas (the built-in 135M on its default low-bit path, where the prefix cache is on) serve ``--conversations``
conversations at once, each a split client kept through its turns (as the edge keeps one), ``--turns`` turns each.

Two phases on the same cluster:

* ``steady``: every replica stays up. A later turn *hits* when the server reports (``reused_tokens``) having taken
  at least what the conversation's last sequence shares with the new prompt, less a block of 32 (the cache keeps
  whole blocks).
* ``kill``: as many other conversations (the next MT-Bench questions); once conversation 0's third turn has
  produced 4 tokens, the replica holding it is killed (``ray.kill``, no shutdown). Its clients go on through the
  cut, and Serve brings a replacement up, cold.

Every turn's output is compared with plain decoding of the same prompt in this process (the same kernels: greedy
tokens must be equal). Every client is waited for a bounded time; one that never returns is reported.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from bench.common import environment, finish, save_figure, table
from client.build import Client, ClientOptions, Shared
from client.drafters import make_drafter
from client.loop.decode import generate
from client.net.endpoint import Endpoint
from client.training.datasets import mtbench_questions
from client.verifiers import LocalVerifier
from server.limits import ServerLimits
from shared.channel import route_key
from shared.engine.models import encode_messages, load_target, resolve_model
from shared.engine.prefixes import BLOCK
from shared.lookup import shared_length

REPO = Path(__file__).resolve().parent.parent
FOLLOW_UPS = {  # the later turns' user lines, per phase
    "steady": ("Explain your answer in two sentences.", "Now give one concrete example.", "Summarize in one line."),
    "kill": ("What is the main point here?", "Give a counterexample.", "Rewrite it for a child."),
}
WAIT_S = 600.0  # a phase's clients are waited for this long at most


@dataclass
class Turn:
    phase: str
    conversation: int
    turn: int
    prompt_tokens: int
    new_tokens: int
    reused: int  # what the server said it took from its prefix cache (at every open: a reopen after a cut too)
    reusable: int  # what the conversation's last sequence shares with this prompt (0 on a first turn)
    disconnects: int
    same: bool | None  # equal to plain decoding in this process
    output: list[int]

    @property
    def hit(self) -> bool:
        return self.reused >= self.reusable - BLOCK


def conversation(args, client: Client, tokenizer, first: tuple[str, str], follow: tuple[str, ...], index: int,
                 phase: str, out: list[Turn], on_turn) -> None:  # fmt: skip
    """One conversation's turns through ``client``; ``on_turn(index, turn)`` may return an ``on_update`` callback."""
    messages, last = [], []
    for t, text in enumerate([*first, *follow][: args.turns]):
        messages.append({"role": "user", "content": text})
        prompt = encode_messages(tokenizer, messages)
        gen = client.generate(prompt, args.max_new_tokens, on_update=on_turn(index, t + 1))
        reusable = min(shared_length(prompt, last), len(prompt) - 1) if last else 0
        out.append(Turn(phase, index, t + 1, len(prompt), len(gen.token_ids), gen.stats.reused_tokens, reusable,
                        gen.stats.disconnects, None, gen.token_ids))  # fmt: skip
        last = prompt + gen.token_ids
        messages.append({"role": "assistant", "content": tokenizer.decode(gen.token_ids, skip_special_tokens=True)})


def run_phase(phase: str, args, address: str, shared: Shared, killed: list) -> tuple[list[Turn], int]:
    """Every conversation at once; returns the turns and how many clients never returned."""
    from server import cluster
    from server.routing import owner

    questions = phase_questions(phase, args.conversations)
    turns: list[Turn] = []
    bar = tqdm(total=args.conversations * args.turns, desc=phase, unit="turn", file=sys.stderr)

    def on_turn(index: int, turn: int):
        if phase != "kill" or index != 0 or turn != 3:
            return lambda tokens, verified: bar.update(0)

        def kill_once(tokens, verified) -> None:
            if len(tokens) >= 4 and not killed:
                victim = owner(key, list(cluster.replicas()))
                killed.append((victim, time.monotonic()))
                cluster.kill(victim)

        return kill_once

    first = questions[0]["turns"][0]
    key = route_key(encode_messages(shared.tokenizer, [{"role": "user", "content": first}]))

    def run(i: int) -> None:
        options = ClientOptions(endpoint=Endpoint(address), drafter=args.drafter, model=args.model)
        with Client(options, shared) as client:
            mine: list[Turn] = []
            try:
                conversation(args, client, shared.tokenizer, tuple(questions[i]["turns"][:2]), FOLLOW_UPS[phase], i,
                             phase, mine, on_turn)  # fmt: skip
            finally:
                turns.extend(mine)
                bar.update(len(mine))

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(args.conversations)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + WAIT_S
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    bar.close()
    return sorted(turns, key=lambda t: (t.conversation, t.turn)), sum(t.is_alive() for t in threads)


def phase_questions(phase: str, count: int) -> list[dict]:
    """Each phase its own MT-Bench questions: a conversation of one never finds another's prefix."""
    start = list(FOLLOW_UPS).index(phase) * count
    return mtbench_questions()[start : start + count]


def check(turns: list[Turn], target) -> None:
    """Each turn's output against plain decoding of its prompt here (same kernels, greedy)."""
    tokenizer = target.tokenizer
    for t in tqdm(turns, desc="plain decoding", unit="turn", file=sys.stderr):
        messages = []
        for earlier in sorted((e for e in turns if e.phase == t.phase and e.conversation == t.conversation
                               and e.turn < t.turn), key=lambda e: e.turn):  # fmt: skip
            messages.append({"role": "user", "content": _user_line(earlier)})
            answer = tokenizer.decode(earlier.output, skip_special_tokens=True)
            messages.append({"role": "assistant", "content": answer})
        messages.append({"role": "user", "content": _user_line(t)})
        prompt = encode_messages(tokenizer, messages)
        want = generate(LocalVerifier(target), make_drafter("none"), prompt, len(t.output) or 1).token_ids
        t.same = want[: len(t.output)] == t.output and len(prompt) == t.prompt_tokens


_LINES: dict[tuple[str, int, int], str] = {}


def _user_line(t: Turn) -> str:
    return _LINES[(t.phase, t.conversation, t.turn)]


def summarize(turns: list[Turn], hung: dict[str, int], killed: list) -> list[dict]:
    rows = []
    for phase in FOLLOW_UPS:
        mine = [t for t in turns if t.phase == phase]
        later = [t for t in mine if t.turn > 1]
        hits = sum(t.hit for t in later)
        rows.append({"phase": phase, "turns": len(mine), "later_turns": len(later),
                     "hits": hits, "hit_rate": round(hits / max(1, len(later)), 3),
                     "reused": sum(t.reused for t in mine), "reusable": sum(t.reusable for t in mine),
                     "disconnects": sum(t.disconnects for t in mine), "same": sum(bool(t.same) for t in mine),
                     "never_returned": hung.get(phase, 0),
                     "killed": killed[0][0] if phase == "kill" and killed else ""})  # fmt: skip
    return rows


def markdown(rows: list[dict]) -> str:
    head = ["phase", "turns", "later turns that hit their replica's cache", "tokens reused / reusable",
            "disconnects", "equal to plain decoding", "clients never returned"]
    body = [[r["phase"], str(r["turns"]), f"{r['hits']}/{r['later_turns']} ({r['hit_rate']:.0%})",
             f"{r['reused']}/{r['reusable']}", str(r["disconnects"]), f"{r['same']}/{r['turns']}",
             str(r["never_returned"])] for r in rows]  # fmt: skip
    return table(head, body)


def plot(turns: list[Turn], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5), sharey=True)
    for ax, phase in zip(axes, FOLLOW_UPS, strict=True):
        for c in sorted({t.conversation for t in turns}):
            mine = [t for t in turns if t.phase == phase and t.conversation == c and t.turn > 1]
            ax.plot([t.turn for t in mine], [t.reused / max(1, t.reusable) for t in mine], marker="o", alpha=0.6)
        ax.set_title(phase)
        ax.set_xlabel("turn")
        ax.set_xticks(sorted({t.turn for t in turns if t.turn > 1}))
        ax.set_ylim(0, 1.05)
    axes[0].set_ylabel("reused ÷ reusable prompt tokens")
    save_figure(fig, path, "Each conversation's later turns on its replica")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.chat_ray", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="the served target (default the built-in 135M)")
    p.add_argument("--drafter", default="prompt-lookup", help="the clients' drafter (default prompt-lookup)")
    p.add_argument("--conversations", type=int, default=8, help="conversations at once (default 8)")
    p.add_argument("--turns", type=int, default=4, help="turns per conversation, 3 to 5 (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens per answer at most (default 32)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "chat-ray")
    args = p.parse_args(argv)
    if not 3 <= args.turns <= 5 or args.conversations < 1:
        p.error(f"expected 3 <= --turns <= 5 and --conversations >= 1, got {args.turns}, {args.conversations}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import ray
    from ray import serve

    from server import cluster

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    target = load_target(args.model, dtype="auto")  # the clients' tokenizer, and plain decoding to compare with
    shared = Shared(target, target.tokenizer, target.fingerprint)
    for phase, follow in FOLLOW_UPS.items():
        for i, q in enumerate(phase_questions(phase, args.conversations)):
            for t, text in enumerate([*q["turns"][:2], *follow][: args.turns]):
                _LINES[(phase, i, t + 1)] = text
    os.environ.update(cluster.ray_environment())
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    port, turns, hung, killed = cluster.free_port(), [], {}, []
    try:
        resolve_model(args.model)
        limits = ServerLimits(max_sessions=4 * args.conversations).as_dict()
        cluster.deploy(cluster.ReplicaConfig(model=args.model, threads=max(1, cpus // 2), limits=limits), 2, port)
        address = f"127.0.0.1:{port}"
        for phase in FOLLOW_UPS:
            mine, hung[phase] = run_phase(phase, args, address, shared, killed)
            turns += mine
            if phase == "kill" and killed:
                cluster.wait_running(2, timeout_s=300)
    finally:
        serve.shutdown()
        ray.shutdown()
    check(turns, target)
    rows = summarize(turns, hung, killed)
    env = environment(cpus)
    report = markdown(rows)
    header = (f"# Conversations across two Ray Serve replicas\n\n`{env['command']}`\n\n{env['date']}, {args.model} "
              f"on 2 replicas ({env['cpu']}, {cpus} CPUs shared), {args.conversations} conversations at once, "
              f"{args.turns} turns each, split clients drafting with {args.drafter}, ≤{args.max_new_tokens} tokens "
              f"a turn, greedy. A later turn hits when the server took at least what its last sequence shares with "
              f"the prompt, less {BLOCK} tokens. Kill: the replica of conversation 0, 4 tokens into its third "
              f"turn{f' ({killed[0][0]})' if killed else ' (never happened)'}.\n\n")  # fmt: skip
    plot(turns, args.out / "chat-ray.png")
    finish(args.out, "chat-ray", {"environment": env, "args": vars(args) | {"out": str(args.out)}, "summary": rows,
                                  "turns": [asdict(t) for t in turns]}, header + report, report)  # fmt: skip
    ok = all(t.same for t in turns) and not any(hung.values()) and bool(killed)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
