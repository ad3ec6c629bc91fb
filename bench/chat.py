"""Conversations, turn by turn, with the prefix caches on and off (``make bench-chat``).

Chat apps and agents send the whole conversation again with every request. Each conversation here is run as an app
runs it: every turn re-encodes the messages so far (the assistant's answers as text) in the chat template and asks
for the next answer. Two settings, side by side, one after the other on the same machine:

* ``off``: a server started with ``--prefix-cache-mb 0`` and a new client (a fresh drafter) for every turn: each
  turn prefills the whole conversation, on both sides;
* ``on``: a server with its prefix cache, and one client kept through the conversation (its drafter goes on from
  the last turn), as the edge endpoint keeps it.

Methods: the split client (``--drafter``, mode auto, through a netsim link), the API baseline (the server decodes
alone and streams, through the same link) and ``local`` (``--local``: the drafter and the target in this process,
with the client's own prefix cache). Conversations: a scripted coding session of 10 turns that edits its own
earlier code, and MT-Bench's two-turn questions (held out from training). Per turn: the prompt's length, time to
first token, decoding tok/s after it, the tokens the server prefilled and took from its cache (its metrics), the
bytes its cache holds. Every turn's output is compared between the settings (greedy: they must be equal).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from bench.common import environment, finish, median, metrics_port, save_figure, scrape, start, table
from client.build import Client, ClientOptions, Shared
from client.net.endpoint import Endpoint
from client.training.datasets import mtbench_questions
from shared.engine.models import encode_messages, load_target
from shared.server_process import ServerChild, cpus_label, two_machines

REPO = Path(__file__).resolve().parent.parent
CODING = (
    "Write a Python function `parse_csv(path)` that reads a CSV file with a header row and returns a list of dicts.",
    "Add type hints and a docstring to `parse_csv`.",
    "Make `parse_csv` skip blank lines and strip the whitespace around every field.",
    "Add a `delimiter` parameter to `parse_csv` that defaults to a comma.",
    "Raise a ValueError naming the line number when a row has the wrong number of fields.",
    "Write a function `summarize(rows, column)` that returns the min, max and mean of a numeric column.",
    "Make `summarize` ignore rows where the column is empty or not a number, and return None when none is left.",
    "Write pytest tests for `parse_csv` and `summarize`, covering the error case.",
    "Refactor both functions into a class `CsvTable` with `from_file` and `summarize` methods, keeping the behaviour.",
    "Show the complete final module: the class, then its tests.",
)
SETTINGS = ("off", "on")


def method_token(method: str) -> str:
    """The bearer token a method's clients present: each method its own caller, its own prefixes."""
    return f"chat-bench-{method}".ljust(24, "x")


@dataclass
class Turn:
    setting: str
    method: str
    conversation: str
    turn: int
    prompt_tokens: int
    new_tokens: int
    ttft_s: float
    decode_tok_s: float
    prefilled: int  # prompt tokens the server computed (its prefix cache's misses)
    reused: int  # prompt tokens whose KV it took from its cache (its hits)
    cache_bytes: int
    token_ids: list[int]
    same: bool | None = None  # the other setting's output for this turn is the same


def conversations(count: int) -> dict[str, list[str]]:
    """{name: its user turns}: the coding session, then ``count`` MT-Bench two-turn questions."""
    chats = {"coding": list(CODING)}
    for q in mtbench_questions()[:count]:
        chats[f"mt-bench-{q['question_id']}"] = list(q["turns"][:2])
    return chats


def run_conversation(make_client, keep: bool, turns: list[str], tokenizer, max_new: int, port: int,
                     label: tuple[str, str, str], bar) -> list[Turn]:  # fmt: skip
    """The turns of one conversation as an app sends them; ``keep``: one client throughout, else one per turn."""
    messages, out, client = [], [], None
    try:
        for i, text in enumerate(turns):
            messages.append({"role": "user", "content": text})
            prompt = encode_messages(tokenizer, messages)
            if client is None or not keep:
                if client is not None:
                    client.close()
                client = make_client()
            before = scrape(port) if port else {}
            gen = client.generate(prompt, max_new)
            s = gen.stats
            rest = max(s.wall_s - s.ttft_s, 1e-9)
            if port:  # the server's own account
                after = scrape(port)
                reused = int(after["splitspec_prefix_hit_tokens"] - before["splitspec_prefix_hit_tokens"])
                prefilled = int(after["splitspec_prefix_miss_tokens"] - before["splitspec_prefix_miss_tokens"])
                held = int(after["splitspec_prefix_bytes"])
            else:  # --local: the client's own target and prefix cache
                reused, held = s.reused_tokens, client.verifier.prefixes.nbytes
                prefilled = len(prompt) - reused
            out.append(Turn(*label, i + 1, len(prompt), s.new_tokens, round(s.ttft_s, 4),
                            round(max(s.new_tokens - 1, 0) / rest, 3), prefilled, reused, held,
                            gen.token_ids))  # fmt: skip
            messages.append({"role": "assistant", "content": tokenizer.decode(gen.token_ids, skip_special_tokens=True)})
            bar.update()
    finally:
        if client is not None:
            client.close()
    return out


def run_setting(setting: str, args, target, chats: dict[str, list[str]], cpus, workdir: Path, netsim) -> list[Turn]:
    from netsim import simulated_link

    tokens = workdir / "tokens"  # a caller identity per method: a prefix is shared only within one
    tokens.write_text("".join(f"{m} {method_token(m)}\n" for m in args.methods))
    serve_args = ["--model", args.model, "--threads", str(args.server_threads), "--metrics-port", "0",
                  "--max-context", str(args.max_context), "--auth-token-file", str(tokens)]
    serve_args += ["--prefix-cache-mb", "0"] if setting == "off" else []
    child = ServerChild(serve_args, workdir / setting, cpus=cpus and cpus[0])
    (workdir / setting).mkdir()
    child.start()
    turns: list[Turn] = []
    try:
        port = metrics_port(workdir / setting / "server.log")
        with contextlib.ExitStack() as stack:
            address = child.address
            if args.profile != "none":
                address = stack.enter_context(simulated_link(child.address, args.profile, netsim=netsim)).address
            shared = Shared(target, target.tokenizer, target.fingerprint)
            bar = tqdm(total=len(args.methods) * sum(map(len, chats.values())), desc=f"chat, caches {setting}",
                       unit="turn", file=sys.stderr)  # fmt: skip
            for method in [m for m in args.methods if m != "local"]:
                def make_client(method=method):
                    api = method == "api"
                    options = ClientOptions(endpoint=Endpoint(address, token=method_token(method)), probe_link=True,
                                            baseline="api" if api else None, drafter=None if api else args.drafter,
                                            device=str(target.device))  # fmt: skip
                    return Client(options, shared)

                for name, user_turns in chats.items():
                    turns += run_conversation(make_client, setting == "on", user_turns, target.tokenizer,
                                              args.max_new_tokens, port, (setting, method, name), bar)  # fmt: skip
            bar.close()
    finally:
        child.stop()
    return turns


def run_local(setting: str, args, target, chats: dict[str, list[str]]) -> list[Turn]:
    """``--local``: the drafter and the target in this process. On: one client kept through a conversation (its
    prefix cache and its drafter go on); off: a fresh one every turn."""
    shared = Shared(target, target.tokenizer, target.fingerprint)

    def make_client() -> Client:
        return Client(ClientOptions(local=True, drafter=args.drafter, device=str(target.device)), shared)

    bar = tqdm(total=sum(map(len, chats.values())), desc=f"chat --local, caches {setting}", unit="turn",
               file=sys.stderr)  # fmt: skip
    turns = []
    for name, user_turns in chats.items():
        turns += run_conversation(make_client, setting == "on", user_turns, target.tokenizer, args.max_new_tokens, 0,
                                  (setting, "local", name), bar)  # fmt: skip
    bar.close()
    return turns


def compare(turns: list[Turn]) -> None:
    """Mark each turn whose output the other setting's same turn equals."""
    by = {(t.setting, t.method, t.conversation, t.turn): t for t in turns}
    for t in turns:
        other = by.get(("on" if t.setting == "off" else "off", t.method, t.conversation, t.turn))
        t.same = None if other is None else other.token_ids == t.token_ids


def summary(turns: list[Turn]) -> list[dict]:
    """Per method and conversation kind: the last turn's and all turns' figures, cache on against off."""
    rows = []
    for method in dict.fromkeys(t.method for t in turns):
        for kind in ("coding", "mt-bench"):
            def pick(setting, kind=kind, method=method):
                return [t for t in turns if t.method == method and t.setting == setting
                        and t.conversation.startswith(kind)]  # fmt: skip

            off, on = pick("off"), pick("on")
            if not off or not on:
                continue
            last = max(t.turn for t in on)
            ttft = [median([t.ttft_s for t in side if t.turn == last]) for side in (off, on)]
            rows.append({
                "method": method, "conversations": kind, "turns": last,
                "ttft_last_off_s": ttft[0], "ttft_last_on_s": ttft[1], "ttft_last_ratio": ttft[1] / ttft[0],
                "prefilled_off": sum(t.prefilled for t in off), "prefilled_on": sum(t.prefilled for t in on),
                "prefill_ratio": sum(t.prefilled for t in on) / max(1, sum(t.prefilled for t in off)),
                "hit_rate_on": sum(t.reused for t in on) / max(1, sum(t.reused + t.prefilled for t in on)),
                "decode_tok_s_off": median([t.decode_tok_s for t in off]),
                "decode_tok_s_on": median([t.decode_tok_s for t in on]),
                "cache_mb_on": max(t.cache_bytes for t in on) / 2**20,
                "same": f"{sum(bool(t.same) for t in on)}/{len(on)}",
            })  # fmt: skip
    return rows


def markdown(rows: list[dict], turns: list[Turn]) -> str:
    head = ["method", "conversations", "turns", "TTFT last turn off → on (s)", "× off",
            "server prefill tokens off → on", "× off", "hit rate on", "decode tok/s off → on", "cache MiB",
            "same output"]  # fmt: skip
    body = [[r["method"], r["conversations"], str(r["turns"]),
             f"{r['ttft_last_off_s']:.2f} → {r['ttft_last_on_s']:.2f}", f"{r['ttft_last_ratio']:.2f}×",
             f"{r['prefilled_off']} → {r['prefilled_on']}", f"{r['prefill_ratio']:.2f}×", f"{r['hit_rate_on']:.0%}",
             f"{r['decode_tok_s_off']:.1f} → {r['decode_tok_s_on']:.1f}", f"{r['cache_mb_on']:.1f}", r["same"]]
            for r in rows]  # fmt: skip
    per_turn = [[t.method, str(t.turn), str(t.prompt_tokens)]
                + [f"{x.ttft_s:.2f}" for x in (off, t)] + [str(off.prefilled), str(t.prefilled), str(t.reused)]
                for t in turns if t.setting == "on" and t.conversation == "coding"
                for off in [next(o for o in turns if o.setting == "off" and o.method == t.method
                                 and o.conversation == "coding" and o.turn == t.turn)]]  # fmt: skip
    return (table(head, body, left=2) + "\n\nThe coding session turn by turn:\n\n"
            + table(["method", "turn", "prompt tokens", "TTFT off (s)", "TTFT on (s)", "prefilled off", "prefilled on",
                     "reused on"], per_turn, left=1))  # fmt: skip


def plot(turns: list[Turn], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for method in dict.fromkeys(t.method for t in turns):
        for setting, style in (("off", "--"), ("on", "-")):
            mine = sorted((t.turn, t.ttft_s) for t in turns if t.method == method and t.setting == setting
                          and t.conversation == "coding")  # fmt: skip
            if mine:
                ax.plot(*zip(*mine, strict=True), style, marker="o", label=f"{method}, caches {setting}")
    ax.set_xlabel("turn of the coding session")
    ax.set_ylabel("time to first token (s)")
    ax.legend()
    save_figure(fig, path, "Time to first token as the conversation grows")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b", help="the served target (default the pair's 1.5B)")
    p.add_argument("--drafter", default="qwen2.5-coder-0.5b", help="the split client's drafter (default the 0.5B)")
    p.add_argument("--methods", default="split,api", help="split (the drafter, mode auto), api, local (the drafter "
                   "and the target here, --local) (default split,api)")
    p.add_argument("--mt-bench", type=int, default=4, help="MT-Bench two-turn conversations (default 4)")
    p.add_argument("--turns", type=int, default=len(CODING),
                   help=f"turns of the coding session (default {len(CODING)})")
    p.add_argument("--profile", default="4g", help="netsim link between client and server (default 4g; none)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per answer at most (default 128)")
    p.add_argument("--max-context", type=int, default=4096, help="the server's context limit (default 4096)")
    p.add_argument("--server-threads", type=int, default=1)
    p.add_argument("--client-threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "chat")
    args = p.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not args.methods or set(args.methods) - {"split", "api", "local"}:
        p.error(f"--methods must name split, api and/or local, got {','.join(args.methods)!r}")
    if not 1 <= args.turns <= len(CODING) or args.mt_bench < 0 or args.max_new_tokens < 1:
        p.error(f"--turns must be 1..{len(CODING)}, --mt-bench >= 0 and --max-new-tokens >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    from netsim import Netsim

    args = parse_args(argv)
    start(args.client_threads)
    target = load_target(args.model, dtype="auto")  # the client's copy: the drafter borrows nothing, it tokenizes
    chats = conversations(args.mt_bench)
    chats["coding"] = chats["coding"][: args.turns]
    cpus = two_machines(args.server_threads, args.client_threads)
    torch.set_num_threads(args.client_threads)
    turns: list[Turn] = []
    with tempfile.TemporaryDirectory(prefix="splitspec-chat-") as tmp, contextlib.ExitStack() as stack:
        remote = set(args.methods) - {"local"}
        netsim = stack.enter_context(Netsim.start_own()) if args.profile != "none" and remote else None
        for setting in SETTINGS:
            if set(args.methods) - {"local"}:
                turns += run_setting(setting, args, target, chats, cpus, Path(tmp), netsim)
            if "local" in args.methods:
                turns += run_local(setting, args, target, chats)
    compare(turns)
    rows = summary(turns)
    env = {**environment(args.client_threads), "server_threads": args.server_threads, "cpus": cpus_label(cpus)}
    report = markdown(rows, turns)
    header = (f"# Conversations with the prefix caches off and on\n\n`{env['command']}`\n\n{env['date']}, {args.model} "
              f"served ({env['cpus']}; {env['cpu']}), the split client drafting with {args.drafter} in mode auto, "
              f"over netsim {args.profile}; greedy, ≤{args.max_new_tokens} new tokens a turn; the coding session's "
              f"{args.turns} turns and {args.mt_bench} MT-Bench two-turn questions; TTFT of the last turn a median "
              "over the conversations of its kind.\n\n")  # fmt: skip
    result = {"environment": env, "args": vars(args) | {"out": str(args.out)}, "summary": rows,
              "turns": [asdict(t) for t in turns]}  # fmt: skip
    plot(turns, args.out / "chat.png")
    finish(args.out, "chat", result, header + report, report)
    return 0 if all(t.same is not False for t in turns) else 1


if __name__ == "__main__":
    sys.exit(main())
