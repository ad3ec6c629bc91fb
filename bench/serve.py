"""Serving many clients: N concurrent clients against one `splitspec serve`, batched vs serial vs API.

So that 32 drafters do not fight the server for the machine's cores, the clients *replay* draft trees
recorded from a real drafter: ``--drafter`` (default eagle) drafts on ``--prompts`` MT-Bench (or ``--dataset
humaneval``) prompts
at every position of the target's greedy output (in this process), and a replaying client sends, after
the same prompt, the tree recorded at the position it has reached, however many tokens the server
accepted so far (all of a tree, or what a server that cuts trees at load verified). The server is the
same target in the same dtype, so its tokens are the recording's (checked: each replay's tokens must
equal the recording's). Client i replays prompt i mod K.

Per server mode and N in ``--clients`` (default 1,2,4,8,16,32), all clients start together and each
generates its recording's tokens: ``batched`` (``--max-batch``, 16), ``whole`` (the same, every node verified:
no cut at load, ``server.budget``), ``serial`` (``--max-batch 1``),
``api`` (each client one Complete stream of the same length, on the batched server: plain decoding,
its steps batched too) and ``auto`` (each client the real decode loop with the adaptive policy in ``--mode auto``,
replaying the recorded trees when it drafts: it streams, tries drafting between stretches, and drafts where the
server's reported load says that spares it compute — ``Load.prefer``, ``step_s``, ``node_s``).
Reported: server tokens/s (all clients' tokens over the wall time), tokens per
target forward and steps per forward (the server's Prometheus metrics), per-client tokens/s (median),
Verify latency p50/p99 as the clients saw it, the server's resident memory at the end, and the server's
compute per generated token (its forward time, from the metrics, over the tokens).

Run:  .venv/bin/python -m bench.serve [--clients 1,2,4,8,16,32] [--prompts 8] [--max-new-tokens 64]
      [--drafter eagle] [--modes batched,whole,serial,api,auto] [--server-threads 2]
Writes serve.json, serve.md and serve.png under --out (default bench/results).
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import torch
from tqdm import tqdm

from bench.common import cell, clients_figure, environment, median, metrics_port, run_clients, save_results, scrape
from client.build import Client, ClientOptions, Shared
from client.drafters import make_drafter
from client.drafters.base import Drafter
from client.loop.decode import Settings, generate
from client.training.datasets import humaneval_problems, mtbench_questions
from client.verifiers import LocalVerifier
from shared.engine.models import DEFAULT_MODEL, encode_prompt, load_target
from shared.server_process import SINGLE_TURN, ServerChild, cpus_label, two_machines
from shared.tree import ROOT, DraftTree, children
from shared.wire import splitspec_pb2 as pb
from shared.wire import splitspec_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parent.parent
MODES = {  # each mode's server flags; BATCH: --max-batch's steps per forward
    "batched": ["--max-batch", "BATCH"],
    "whole": ["--max-batch", "BATCH", "--min-tree-nodes", "1000000"],
    "serial": ["--max-batch", "1"],
    "api": ["--max-batch", "BATCH"],
    "auto": ["--max-batch", "BATCH"],
}
TIMEOUT = 600.0


@dataclass
class Recording:
    prompt: list[int]
    trees: list[DraftTree]  # trees[g - 1]: what the drafter drafts after g generated tokens
    tokens: list[int]  # what the target generated after the prompt

    def tree(self, generated: int) -> DraftTree:
        return self.trees[generated - 1]

    def rounds(self) -> int:
        """Verifications to generate the tokens when every tree is verified whole (greedy)."""
        g, rounds = 1, 0
        while g < len(self.tokens):
            g, rounds = g + len(accepted_path(self.tree(g), self.tokens[g:])) + 1, rounds + 1
        return rounds


def accepted_path(tree: DraftTree, upcoming: list[int]) -> list[int]:
    """The nodes greedy acceptance takes: the path whose tokens are the ones the target generates next."""
    kids, path, node = children(tree.parents), [], ROOT
    while len(path) < len(upcoming):
        match = [c for c in kids[node + 1] if tree.tokens[c] == upcoming[len(path)]]
        if not match:
            break
        node = match[0]
        path.append(node)
    return path


@dataclass
class Point:
    mode: str
    clients: int
    tokens: int
    wall_s: float
    server_tokens_per_s: float
    client_tokens_per_s: float  # median over clients
    tokens_per_forward: float | None
    steps_per_forward: float | None
    verify_p50_ms: float | None
    verify_p99_ms: float | None
    server_compute_ms_per_token: float | None
    server_rss_mb: float | None
    nodes_verified: float | None  # of the nodes sent (the rest cut by the server at load)
    exact: bool
    streamed: float | None = None  # share of the tokens the server decoded by itself (mode auto)


DATASETS = {"mt-bench": "MT-Bench", "humaneval": "HumanEval"}


def prompt_texts(dataset: str, k: int) -> list[str]:
    """The first ``k`` MT-Bench first turns, or HumanEval problems as ``bench.single`` asks for them."""
    if dataset == "humaneval":
        from bench.single import HUMANEVAL_TEMPLATE

        return [HUMANEVAL_TEMPLATE.format(prompt=p["prompt"]) for p in humaneval_problems()[:k]]
    return [q["turns"][0] for q in mtbench_questions()[:k]]


def record(target, drafter_name: str, prompts: list[list[int]], max_new: int) -> list[Recording]:
    """Each prompt decoded greedily by the in-process target one token a round, the drafter drafting at every
    position: whatever a server verifies of a tree (all, or the first nodes when it cuts at load), a replaying
    client is at a position where the drafter's own tree is known."""
    recordings = []
    for prompt in tqdm(prompts, desc=f"recording {drafter_name} trees", unit="prompt", file=sys.stderr):
        drafter = make_drafter(drafter_name, target=target)
        verifier = LocalVerifier(target)
        trees = []
        verify = verifier.verify

        def recorded(tree, timeout_s=None, *, spec, verify=verify, trees=trees):
            trees.append(DraftTree(list(tree.tokens), list(tree.parents)))
            return verify(DraftTree(), timeout_s, spec=spec)  # one token: the drafter drafts again at the next one

        verifier.verify = recorded
        gen = generate(verifier, drafter, prompt, max_new, Settings(max_tree_nodes=16))
        recordings.append(Recording(prompt, trees, gen.token_ids))
    return recordings


def replay(stub, rec: Recording, latencies: list[float], metadata=None,
           reopens: list[int] | None = None) -> tuple[list[int], float]:  # fmt: skip
    """Open a session with the recording's prompt and send the drafter's tree at each position it reaches;
    (tokens generated, seconds). ``metadata`` goes with every call (a cluster's route key). With ``reopens``, a
    session the server does not know (NOT_FOUND: a cluster routed the call to another replica) is reopened from the
    prompt and the tokens so far, as the split client does, and counted there."""

    def open_(tokens: list[int]):
        return stub.OpenSession(pb.OpenSessionRequest(prompt_ids=rec.prompt + tokens), timeout=TIMEOUT,
                                metadata=metadata)  # fmt: skip

    start = time.perf_counter()
    opened = open_([])
    tokens, length = [opened.first_token], opened.length
    while len(tokens) < len(rec.tokens):
        tree = rec.tree(len(tokens))
        t0 = time.perf_counter()
        try:
            reply = stub.Verify(pb.VerifyRequest(session_id=opened.session_id, tokens=tree.tokens,
                                                 parents=tree.parents, length=length), timeout=TIMEOUT,
                                metadata=metadata)  # fmt: skip
        except grpc.RpcError as exc:
            if reopens is None or exc.code() != grpc.StatusCode.NOT_FOUND:
                raise
            reopens.append(1)
            opened = open_(tokens[:-1])  # its first token is the last one received again (greedy)
            length = opened.length
            continue
        latencies.append(time.perf_counter() - t0)
        tokens += [tree.tokens[i] for i in reply.accepted] + [reply.bonus_token]
        length = reply.length
    with contextlib.suppress(grpc.RpcError):  # a close routed away from its session changes nothing
        stub.CloseSession(pb.CloseSessionRequest(session_id=opened.session_id), timeout=TIMEOUT, metadata=metadata)
    return tokens, time.perf_counter() - start


class Replay(Drafter):
    """A drafter that proposes the recorded tree at the position it has reached (mode auto's clients)."""

    name = "replay"

    def __init__(self, rec: Recording):
        self.rec = rec

    def begin(self, tokens: list[int], features=None) -> None:
        self.generated = len(tokens) - len(self.rec.prompt)

    def propose(self, max_nodes: int, depth: int | None = None) -> DraftTree:
        if self.generated >= len(self.rec.tokens):
            return DraftTree()
        tree = self.rec.tree(self.generated)
        return DraftTree(tree.tokens, tree.parents).head(min(max_nodes, len(tree)))

    def absorb(self, tokens: list[int], features=None) -> None:
        self.generated += len(tokens)

    def rewind(self, n: int) -> None:
        self.generated -= n


def adaptive(address: str, rec: Recording) -> tuple[list[int], float, int]:
    """The decode loop in mode auto, drafting by replay; (tokens, seconds, tokens the server decoded itself)."""
    start = time.perf_counter()
    # (the recorded trees hold at most 16 nodes: the policy sizes within them, unpinned)
    options = ClientOptions(server=address, rpc_timeout_s=TIMEOUT, on_reconnect="fail", heartbeat=False,
                            stop_ids=())  # fmt: skip
    with Client(options, Shared(None, None), Replay(rec)) as client:
        gen = client.generate(rec.prompt, len(rec.tokens))
    return gen.token_ids, time.perf_counter() - start, gen.stats.streamed_tokens


def stream(stub, rec: Recording) -> tuple[list[int], float]:
    start = time.perf_counter()
    request = pb.CompleteRequest(prompt_ids=rec.prompt, max_new_tokens=len(rec.tokens))
    tokens = [t for chunk in stub.Complete(request, timeout=TIMEOUT) for t in chunk.tokens]
    return tokens, time.perf_counter() - start


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def run_point(child: ServerChild, port: int, mode: str, n: int, recordings: list[Recording]) -> Point:
    before = scrape(port)
    channels = [grpc.insecure_channel(child.address) for _ in range(n)]
    stubs = [pb_grpc.SplitSpecStub(c) for c in channels]
    results: list = [None] * n
    latencies: list[float] = []
    barrier = threading.Barrier(n)

    def client(i: int) -> None:
        rec = recordings[i % len(recordings)]
        barrier.wait()
        if mode == "auto":
            results[i] = adaptive(child.address, rec)
        else:
            results[i] = stream(stubs[i], rec) if mode == "api" else replay(stubs[i], rec, latencies)

    wall = run_clients(client, n)
    for c in channels:
        c.close()
    after = scrape(port)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    tokens = sum(min(len(r[0]), len(recordings[i % len(recordings)].tokens)) for i, r in enumerate(results))
    exact = all(results[i][0][: len(recordings[i % len(recordings)].tokens)] == recordings[i % len(recordings)].tokens
                for i in range(n))  # fmt: skip
    forwards = delta("splitspec_forward_tokens_count")
    verified, cut = delta("splitspec_tokens_verified_total"), delta("splitspec_tree_nodes_cut_total")
    share = round(verified / (verified + cut), 3) if verified + cut else None
    lat = sorted(latencies)
    return Point(mode, n, tokens, round(wall, 3), round(tokens / wall, 2),
                 median([len(r[0]) / r[1] for r in results]),
                 round(delta("splitspec_forward_tokens_sum") / forwards, 2) if forwards else None,
                 round(delta("splitspec_forward_sessions_sum") / forwards, 2) if forwards else None,
                 round(1000 * lat[len(lat) // 2], 1) if lat else None,
                 round(1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], 1) if lat else None,
                 round(1000 * delta("splitspec_forward_seconds_total") / tokens, 2) if tokens else None,
                 rss_mb(child.process.pid), share, exact,
                 round(sum(r[2] for r in results) / tokens, 3) if mode == "auto" and tokens else None)  # fmt: skip


def markdown(points: list[Point], args, recordings: list[Recording], cpus: str, env: dict) -> str:
    rounds = sum(r.rounds() for r in recordings)
    tau = sum(len(r.tokens) - 1 for r in recordings) / max(rounds, 1)
    lines = [
        f"# Serving many clients\n\n`{env['command']}`\n\n{env['date']}, {args.model} on {env.get('gpu', args.device)} "
        f"(dtype {args.dtype}), {env['cpu_count']} CPUs "
        f"({env['cpu']}). Replayed {args.drafter} trees (τ {tau:.2f} over {len(recordings)} "
        f"{DATASETS[args.dataset]} prompts, ≤ 16 nodes, "
        f"{args.max_new_tokens} tokens each); server child {args.server_threads} threads; "
        f"{cpus}.",
        "",
        "| mode | clients | server tok/s | tok/forward | steps/forward | client tok/s | verify p50 ms "
        "| verify p99 ms | server ms/token | RSS MB | nodes verified | decoded by the server | exact |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for p in points:
        lines.append(f"| {p.mode} | {p.clients} | {p.server_tokens_per_s:.1f} | {cell(p.tokens_per_forward, '.1f')} | "
                     f"{cell(p.steps_per_forward, '.2f')} | {cell(p.client_tokens_per_s, '.1f')} | "
                     f"{cell(p.verify_p50_ms, '.0f')} | {cell(p.verify_p99_ms, '.0f')} | "
                     f"{cell(p.server_compute_ms_per_token, '.1f')} | {cell(p.server_rss_mb, '.0f')} | "
                     f"{cell(p.nodes_verified, '.0%')} | {cell(p.streamed, '.0%')} | "
                     f"{'yes' if p.exact else 'NO'} |")  # fmt: skip
    return "\n".join(lines)


def figure(points: list[Point], out: Path) -> None:
    series = {}
    for mode in dict.fromkeys(p.mode for p in points):
        ps = [p for p in points if p.mode == mode]
        series[mode] = ([p.clients for p in ps], [p.server_tokens_per_s for p in ps],
                        None if mode == "api" else [p.verify_p99_ms for p in ps])  # fmt: skip
    clients_figure(series, "server tokens/s", "Verify p99 latency, ms", out / "serve.png", "splitspec serve under load")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", default="1,2,4,8,16,32", help="comma list of concurrent client counts")
    p.add_argument("--modes", default=",".join(MODES), help="comma list of batched, whole, serial, api, auto")
    p.add_argument("--prompts", type=int, default=8, help="prompts to record trees on (default 8)")
    p.add_argument("--dataset", choices=list(DATASETS), default="mt-bench", help="their dataset (default mt-bench)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per client (default 64)")
    p.add_argument("--drafter", default="eagle", help="whose trees to replay (default eagle)")
    p.add_argument("--server-threads", type=int, default=2, help="torch threads of the server child (default 2)")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--device", default="cpu", help="where the server (and the recording target) runs: cpu, cuda "
                   "or cuda:N (default cpu); the trees are recorded on the same device and dtype, so a replay's "
                   "tokens are the served target's")
    p.add_argument("--dtype", default="auto", help="the served target's dtype (default auto)")
    p.add_argument("--cuda-graphs", action="store_true", help="record and serve the target's forwards on CUDA graphs "
                   "(`serve --cuda-graphs`)")  # fmt: skip
    p.add_argument("--max-batch", type=int, default=16, help="steps per target forward, all modes but serial "
                   "(default 16; a GPU's batch is hundreds)")  # fmt: skip
    p.add_argument("--server-args", default="", help="more `splitspec serve` flags for every mode, e.g. "
                   "\"--max-batch-tokens 8192 --kv-memory-mb 65536\"")  # fmt: skip
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = p.parse_args(argv)
    counts = [int(c) for c in args.clients.split(",")]
    modes = args.modes.split(",")
    unknown = set(modes) - set(MODES)
    if unknown:
        p.error(f"unknown modes {sorted(unknown)}; expected some of {', '.join(MODES)}")

    # the child's thread count here too: ``auto`` chooses the served path by timing at that count (a GGUF off the
    # 4-bit grid gets fp32 on 2 threads, int8 on 1), so the recording is made on the path the server serves
    torch.set_num_threads(args.server_threads)
    target = load_target(args.model, device=args.device, dtype=args.dtype, graphs=args.cuda_graphs)
    prompts = [encode_prompt(target.tokenizer, text, chat=True) for text in prompt_texts(args.dataset, args.prompts)]
    recordings = record(target, args.drafter, prompts, args.max_new_tokens)
    del target
    points: list[Point] = []
    cpus = two_machines(args.server_threads, 1)  # the replaying clients on a core of their own, if one is left
    env = environment(args.server_threads, args.device)

    def save() -> str:
        """The table so far: a run cut short (a lent GPU's minutes) still leaves the points it reached."""
        md = markdown(points, args, recordings, cpus_label(cpus), env)
        result = {"environment": env, "args": vars(args) | {"out": str(args.out)},
                  "points": [asdict(p) for p in points]}  # fmt: skip
        save_results(args.out, "serve", result, md)
        return md

    with tempfile.TemporaryDirectory(prefix="splitspec-serve-") as workdir:
        for mode in modes:
            serve_args = ["--model", args.model, "--device", args.device, "--dtype", args.dtype,
                          "--threads", str(args.server_threads), "--max-sessions",
                          str(2 * max(counts)), "--metrics-port", "0", *SINGLE_TURN,
                          *(["--cuda-graphs"] if args.cuda_graphs else []), *shlex.split(args.server_args),
                          *(str(args.max_batch) if flag == "BATCH" else flag for flag in MODES[mode])]  # fmt: skip
            child = ServerChild(serve_args, Path(workdir) / mode, cpus=cpus and cpus[0])
            (Path(workdir) / mode).mkdir()
            child.start()
            try:
                port = metrics_port(Path(workdir) / mode / "server.log")
                for n in tqdm(counts, desc=f"serve {mode}", unit="N", file=sys.stderr):
                    points.append(run_point(child, port, mode, n, recordings))
                    tqdm.write(str(points[-1]), file=sys.stderr)
                    save()
            finally:
                child.stop()
    print(save())
    figure(points, args.out)
    print(f"\nwrote {args.out}/serve.{{json,md,png}}")
    return 0 if all(p.exact for p in points) else 1


if __name__ == "__main__":
    sys.exit(main())
