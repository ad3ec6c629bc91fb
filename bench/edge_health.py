"""The edge's `/health` while it streams: how long a health check waits when ``--streams`` generations run at once.

A `splitspec serve` child (the built-in 135M target by default) and a `splitspec edge` child in front of it, both on
loopback; where the machine has the CPUs, the server on its own and the edge (with this process, which only asks)
on another, as two machines. First ``--idle-polls`` health checks with nothing running, then ``--streams`` streamed
completions at once (``--max-tokens`` each, temperature 0), and meanwhile a `GET /health` every ``--poll-ms``, each on
a new connection, as a load balancer's probe. Reported: the health checks' latency (median, p95, max) while every
stream was generating, and idle; each check's status and ``server_serving``. Bounded: the streams end after
``--max-tokens``, and the run is abandoned after ``--limit-s``.

Run:  .venv/bin/python -m bench.edge_health [--streams 12] [--max-tokens 64] [--poll-ms 100]
Writes edge-health.json and edge-health.md under --out (default bench/results/edge-health).
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.common import finish, machine, median
from shared.engine.models import DEFAULT_MODEL
from shared.server_process import ServerChild, cpus_label, disjoint_cpus, pin_process

REPO = Path(__file__).resolve().parent.parent
PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a hash map is in two sentences.",
    "Write a haiku about the sea.",
    "List three uses of a binary search tree.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "What is the capital of France, and why is it famous?",
    "Write a SQL query that counts the rows of a table named users.",
    "Give me a recipe for pancakes.",
    "Write a Python class for a stack with push and pop.",
    "Summarise the rules of chess in a paragraph.",
    "Write a shell command that lists the largest files in a folder.",
    "Describe the water cycle to a child.",
]


@dataclass
class Check:
    at_s: float  # since the streams were started
    latency_ms: float
    status: int  # 0: no answer (the error is in ``error``)
    serving: bool | None
    generating: int  # streams generating when it was sent
    error: str = ""


@dataclass
class Stream:
    tokens: int = 0
    chunks: int = 0
    first_chunk_s: float | None = None
    wall_s: float = 0.0
    error: str = ""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get(port: int, path: str, timeout_s: float) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("GET", path)
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read() or b"{}")
    finally:
        conn.close()


def check(port: int, began: float, generating: int, timeout_s: float) -> Check:
    """One `GET /health` on a new connection, timed."""
    start = time.perf_counter()
    try:
        status, body = get(port, "/health", timeout_s)
        error, serving = "", body.get("server_serving")
    except (OSError, ValueError) as exc:
        status, serving, error = 0, None, f"{type(exc).__name__}: {exc}"
    return Check(round(start - began, 3), round(1000 * (time.perf_counter() - start), 2), status, serving, generating,
                 error)  # fmt: skip


def stream(port: int, model: str, prompt: str, max_tokens: int, timeout_s: float, began: float, out: Stream,
           started: threading.Event) -> None:  # fmt: skip
    """One streamed chat completion, read to its end ([DONE])."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        reply = conn.getresponse()
        if reply.status != 200:
            out.error = f"HTTP {reply.status}: {reply.read()[:200]!r}"
            return
        while line := reply.readline():
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix(b"data: "))
            if "error" in chunk:  # the generation failed once the stream had begun
                out.error = f"in the stream: {chunk['error'].get('message', chunk['error'])}"
            if chunk.get("usage"):
                out.tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    out.chunks += 1
                    if out.first_chunk_s is None:
                        out.first_chunk_s = round(time.perf_counter() - began, 3)
                        started.set()
    except (OSError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
        out.wall_s = round(time.perf_counter() - began, 3)


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (nearest rank) of ``values``; None for none."""
    if not values:
        return None
    ranked = sorted(values)
    return ranked[min(len(ranked) - 1, max(0, round(q * len(ranked) + 0.5) - 1))]


def summary(checks: list[Check]) -> dict:
    latencies = [c.latency_ms for c in checks]
    return {"checks": len(checks), "median_ms": percentile(latencies, 0.5), "p95_ms": percentile(latencies, 0.95),
            "max_ms": max(latencies, default=None), "not_200": sum(c.status != 200 for c in checks),
            "not_serving": sum(c.serving is not True for c in checks)}  # fmt: skip


def start_edge(args, server: str, port: int, workdir: Path, cpus: set[int] | None) -> subprocess.Popen:
    """`splitspec edge` as a user starts it, found ready by its /v1/models."""
    cmd = [sys.executable, "-m", "shared.cli", "edge", "--server", server, "--port", str(port), "--model", args.model,
           "--drafter", args.drafter, "--threads", str(args.edge_threads)]  # fmt: skip
    with open(workdir / "edge.log", "w") as log:  # (the child keeps its own handle)
        edge = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    if cpus:
        pin_process(cpus, edge.pid)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and edge.poll() is None:
        try:
            if get(port, "/v1/models", 5)[0] == 200:
                return edge
        except OSError:
            time.sleep(0.2)
    edge.kill()
    raise SystemExit(f"the edge did not come up: {(workdir / 'edge.log').read_text()[-2000:]}")


def measure(args, port: int) -> tuple[list[Check], list[Check], list[Stream]]:
    """Idle checks, then ``rounds`` rounds of the streams at once."""
    idle = []
    for _ in range(args.idle_polls):
        idle.append(check(port, time.perf_counter(), 0, args.limit_s))
        time.sleep(args.poll_ms / 1000)
    loaded, streams = [], []
    for _ in range(args.rounds):
        checks, ended = one_round(args, port)
        loaded += checks
        streams += ended
    return idle, loaded, streams


def one_round(args, port: int) -> tuple[list[Check], list[Stream]]:
    """The streams, all started at once, with a check every ``poll_ms`` until they end (or ``limit_s``)."""
    began = time.perf_counter()
    streams = [Stream() for _ in range(args.streams)]
    firsts = [threading.Event() for _ in streams]
    threads = [threading.Thread(target=stream, daemon=True, name=f"bench-stream-{i}",
                                args=(port, args.model, PROMPTS[i % len(PROMPTS)], args.max_tokens, args.limit_s,
                                      began, streams[i], firsts[i]))  # fmt: skip
               for i in range(args.streams)]  # fmt: skip
    for t in threads:
        t.start()
    loaded, deadline = [], began + args.limit_s
    while any(t.is_alive() for t in threads) and time.perf_counter() < deadline:
        generating = sum(f.is_set() and t.is_alive() for f, t in zip(firsts, threads, strict=True))
        sent = time.perf_counter()
        loaded.append(check(port, began, generating, args.limit_s))
        time.sleep(max(0.0, args.poll_ms / 1000 - (time.perf_counter() - sent)))
    for t, s in zip(threads, streams, strict=True):
        t.join(max(0.0, deadline - time.perf_counter()))
        if t.is_alive():
            s.error = f"still open after --limit-s {args.limit_s:g}"
    return loaded, streams


def markdown(args, env: dict, cpus: str, rows: dict[str, dict], streams: list[Stream]) -> str:
    lines = [
        "# The edge's /health while it streams",
        "",
        f"`{env['command']}`",
        "",
        f"{env['date']} · {env['cpu']} ({env['cpu_count']} CPUs, load {env['load_avg_1m']:.2f} at the start) · "
        f"{cpus} · model {args.model}, drafter {args.drafter}, edge threads {args.edge_threads}, server threads "
        f"{args.server_threads}",
        "",
        f"{args.rounds} rounds of {args.streams} streamed chat completions at once ({args.max_tokens} tokens at most "
        f"each, temperature 0); a `GET /health` every {args.poll_ms} ms on a new connection meanwhile.",
        "",
        "| checks | n | median ms | p95 ms | max ms | not 200 | not serving |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in rows.items():
        cells = [f"{v:.1f}" if isinstance(v, float) else "–" if v is None else str(v)
                 for v in (s["median_ms"], s["p95_ms"], s["max_ms"])]  # fmt: skip
        lines.append(f"| {name} | {s['checks']} | {' | '.join(cells)} | {s['not_200']} | {s['not_serving']} |")
    done = [s for s in streams if not s.error]
    tokens = sum(s.tokens for s in done)
    lines += ["", f"Streams: {len(done)} of {len(streams)} ended cleanly, {tokens} tokens; from its round's start to "
              f"its end a stream took {median([s.wall_s for s in streams]) or 0:.1f} s (median)."]  # fmt: skip
    lines += [f"* stream {i}: {s.error}" for i, s in enumerate(streams) if s.error]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"the served target (default {DEFAULT_MODEL})")
    p.add_argument("--drafter", default="prompt-lookup", help="the edge's drafter (default prompt-lookup)")
    p.add_argument("--streams", type=int, default=12, help="streams at once (default 12)")
    p.add_argument("--rounds", type=int, default=3, help="times the streams are started at once (default 3)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per stream at most (default 64)")
    p.add_argument("--poll-ms", type=int, default=100, help="time between health checks (default 100)")
    p.add_argument("--idle-polls", type=int, default=10, help="health checks before the streams (default 10)")
    p.add_argument("--limit-s", type=float, default=300.0, help="the run is abandoned after this (default 300)")
    p.add_argument("--server-threads", type=int, default=1, help="torch threads of the server (default 1)")
    p.add_argument("--edge-threads", type=int, default=1, help="torch threads of the edge (default 1)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "edge-health")
    args = p.parse_args(argv)

    cpus = disjoint_cpus(args.server_threads, args.edge_threads)  # the edge and this process share the second part
    if cpus is not None:
        pin_process(cpus[1])
    with tempfile.TemporaryDirectory(prefix="splitspec-edge-health-") as workdir:
        child = ServerChild(["--model", args.model, "--threads", str(args.server_threads), "--max-sessions",
                             str(2 * args.streams)], Path(workdir), cpus=cpus and cpus[0])  # fmt: skip
        server = child.start()
        edge = None
        try:
            port = free_port()
            edge = start_edge(args, server, port, Path(workdir), cpus and cpus[1])
            idle, loaded, streams = measure(args, port)
        finally:
            if edge is not None:
                edge.terminate()
                try:
                    edge.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    edge.kill()
            child.stop()
    env = machine()
    rows = {f"all {args.streams} streams generating": summary([c for c in loaded if c.generating == args.streams]),
            "while any stream is open": summary(loaded), "idle (before)": summary(idle)}  # fmt: skip
    md = markdown(args, env, cpus_label(cpus), rows, streams)
    result = {"environment": env, "cpus": cpus_label(cpus), "args": vars(args) | {"out": str(args.out)},
              "summary": rows, "idle": [asdict(c) for c in idle], "loaded": [asdict(c) for c in loaded],
              "streams": [asdict(s) for s in streams]}  # fmt: skip
    return finish(args.out, "edge-health", result, md, png=False)


if __name__ == "__main__":
    sys.exit(main())
