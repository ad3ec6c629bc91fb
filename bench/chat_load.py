"""Many conversations against one server under a small prefix budget (``make bench-chat-load``).

What ``bench.chat`` does not show: that the server's prefix cache stays bounded when conversations keep coming, and
that two callers never share a prefix. Two callers (their own bearer tokens) take turns: conversation i of the first,
then the same conversation i of the second, so the second could only ever hit its own past, never the first's
(each MT-Bench question is asked by both). Each conversation is two turns through the API (the server decodes and
streams), the second turn sending the first again with its answer, as apps do. After every turn the server's
metrics are read: bytes held (never above the budget), hits, misses, evictions.

The isolation check: a turn's reused tokens are at most what its own caller's earlier sequences (prompts with
their answers) share with its prompt. A prefix taken from the other caller would show as more.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from bench.chat import method_token
from bench.common import environment, finish, metrics_port, save_figure, scrape, start, table
from client.build import Client, ClientOptions, Shared
from client.net.endpoint import Endpoint
from client.training.datasets import mtbench_questions
from shared.engine.models import encode_messages, load_target
from shared.lookup import shared_length
from shared.server_process import ServerChild

REPO = Path(__file__).resolve().parent.parent
CALLERS = ("alice", "bob")


@dataclass
class Turn:
    conversation: int
    caller: str
    turn: int
    prompt_tokens: int
    reused: int  # the server's hit tokens for this turn
    own_bound: int  # the most its caller's own earlier sequences share with the prompt
    bytes_held: int
    entries: int
    evictions: int


def run(args: argparse.Namespace, target, workdir: Path) -> list[Turn]:
    """Every conversation, both callers, against one server child; a Turn per turn."""
    tokens = workdir / "tokens"
    tokens.write_text("".join(f"{c} {method_token(c)}\n" for c in CALLERS))
    child = ServerChild(["--model", args.model, "--threads", str(args.server_threads), "--metrics-port", "0",
                         "--prefix-cache-mb", str(args.budget_mb), "--auth-token-file", str(tokens)],
                        workdir / "server")  # fmt: skip
    (workdir / "server").mkdir()
    child.start()
    questions = mtbench_questions()
    shared = Shared(target, target.tokenizer, target.fingerprint)
    history: dict[str, list[list[int]]] = {c: [] for c in CALLERS}  # each caller's sequences so far
    turns: list[Turn] = []
    try:
        port = metrics_port(workdir / "server" / "server.log")
        options = {c: ClientOptions(endpoint=Endpoint(child.address, token=method_token(c)), baseline="api",
                                    drafter=None, device=str(target.device)) for c in CALLERS}  # fmt: skip
        clients = {c: Client(o, shared) for c, o in options.items()}
        bar = tqdm(total=args.conversations * 2, desc="conversations", unit="turn", file=sys.stderr)
        for i in range(args.conversations):
            caller, question = CALLERS[i % 2], questions[(i // 2) % len(questions)]
            messages: list[dict] = []
            for n, text in enumerate(question["turns"][:2]):
                messages.append({"role": "user", "content": text})
                prompt = encode_messages(target.tokenizer, messages)
                bound = max((shared_length(prompt, seq) for seq in history[caller]), default=0)
                hits = scrape(port)["splitspec_prefix_hit_tokens"]
                answer = clients[caller].generate(prompt, args.max_new_tokens).token_ids
                now = {k.removeprefix("splitspec_prefix_"): int(v) for k, v in scrape(port).items()
                       if k.startswith("splitspec_prefix_")}  # fmt: skip
                history[caller].append(prompt + answer)
                turns.append(Turn(i, caller, n + 1, len(prompt), int(now["hit_tokens"] - hits),
                                  min(bound, len(prompt) - 1), now["bytes"], now["entries"], now["evictions"]))
                text = target.tokenizer.decode(answer, skip_special_tokens=True)
                messages.append({"role": "assistant", "content": text})
                bar.update()
        bar.close()
        for client in clients.values():
            client.close()
        final = scrape(port)
    finally:
        child.stop()
    turns[-1].evictions = int(final["splitspec_prefix_evictions"])
    return turns


def summarize(turns: list[Turn], budget: int) -> dict:
    reused = sum(t.reused for t in turns)
    prompts = sum(t.prompt_tokens for t in turns)
    return {"conversations": len({t.conversation for t in turns}), "turns": len(turns), "budget_bytes": budget,
            "max_bytes_held": max(t.bytes_held for t in turns),
            "within_budget": all(t.bytes_held <= budget for t in turns),
            "hit_rate": round(reused / prompts, 4),
            "second_turn_hit_rate": round(sum(t.reused for t in turns if t.turn == 2)
                                          / sum(t.prompt_tokens for t in turns if t.turn == 2), 4),
            "evictions": turns[-1].evictions, "max_entries": max(t.entries for t in turns),
            "over_own_bound": sum(t.reused > t.own_bound for t in turns)}  # fmt: skip


def markdown(s: dict) -> str:
    head = ["conversations", "turns", "budget MiB", "most held MiB", "within budget", "hit rate (all tokens)",
            "hit rate (second turns)", "evictions", "most entries", "turns reusing more than their caller's own"]
    row = [str(s["conversations"]), str(s["turns"]), f"{s['budget_bytes'] / 2**20:.1f}",
           f"{s['max_bytes_held'] / 2**20:.2f}", "yes" if s["within_budget"] else "**no**", f"{s['hit_rate']:.0%}",
           f"{s['second_turn_hit_rate']:.0%}", str(s["evictions"]), str(s["max_entries"]), str(s["over_own_bound"])]
    return table(head, [row], left=0)


def plot(turns: list[Turn], budget: int, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    x = range(1, len(turns) + 1)
    ax.plot(x, [t.bytes_held / 2**20 for t in turns], label="held")
    ax.axhline(budget / 2**20, linestyle="--", color="grey", label="budget")
    ax.set_xlabel("turn")
    ax.set_ylabel("prefix cache (MiB)")
    ax.legend(loc="lower right")
    save_figure(fig, path, "The server's prefix cache over many conversations")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.chat_load", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="the served target (default the built-in 135M)")
    p.add_argument("--conversations", type=int, default=200, help="two-turn conversations, the callers alternating")
    p.add_argument("--budget-mb", type=float, default=32, help="the server's --prefix-cache-mb (default 32)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="tokens per answer at most (default 16)")
    p.add_argument("--server-threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "chat-load")
    args = p.parse_args(argv)
    if args.conversations < 2 or args.budget_mb <= 0:
        p.error(f"expected --conversations >= 2 and --budget-mb > 0, got {args.conversations} and {args.budget_mb}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start(1)
    target = load_target(args.model, dtype="auto")  # the client's copy: it tokenizes
    with tempfile.TemporaryDirectory(prefix="splitspec-chat-load-") as tmp:
        turns = run(args, target, Path(tmp))
    budget = int(args.budget_mb * 2**20)
    s = summarize(turns, budget)
    env = environment(1)
    report = markdown(s)
    header = (f"# Many conversations, one prefix budget\n\n`{env['command']}`\n\n{env['date']}, {args.model} served "
              f"({env['cpu']}); two callers alternating, {args.conversations} two-turn MT-Bench conversations "
              f"through the API, ≤{args.max_new_tokens} new tokens a turn.\n\n")  # fmt: skip
    plot(turns, budget, args.out / "chat-load.png")
    finish(args.out, "chat-load", {"environment": env, "args": vars(args) | {"out": str(args.out)}, "summary": s,
                                   "turns": [asdict(t) for t in turns]}, header + report, report)  # fmt: skip
    return 0 if s["within_budget"] and s["over_own_bound"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
