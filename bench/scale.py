"""Past one server: `serve --ray` with 1 and 2 replicas beside one `splitspec serve`, and replicas killed.

The clients replay draft trees recorded from a real drafter (as ``bench.serve``: 16 drafters would
otherwise fight the servers for this machine's cores), each sending its session's route key as the
split client does. Per setup — ``serve`` (one process, ``--threads`` all the CPUs), ``ray×R`` (R
replicas, the CPUs shared out) — and N in ``--clients``: aggregate tokens/s, Verify p50/p99 as the
clients saw it, route misses (calls that found no session on their replica) and whether every output
equals the recording (the same target, greedy).

The router's cost: one client's sequential Verify of a one-node tree (the session rolled back each
time, so every call does the same work) through Serve's proxy against the same call on one server,
and Probe calls per second through each with 16 threads (the proxy's ceiling on this machine).

Kills: ``--kills`` rounds of ``--kill-clients`` clients (default 4) running the real decode loop (replaying,
default resilience) on 2 replicas; in each, the replica holding client 0's session is killed before its third
Verify. Every client must return and every output equal the recording; reported per round: client 0's time off its
server (offline generation until the reopened session settled), Serve's time to bring the replica back, and the
longest any client went on after that (its remaining tokens included: a client stuck behind the dead replica shows
here). A client still running ``HUNG_AFTER_S`` after the replica is back is counted as never returning. ``--pin
CPUS`` puts this process, Ray and every replica on those CPUs (``--pin 0``: all on one core, a loaded slow machine).

Run:  .venv/bin/python -m bench.scale [--clients 1,2,4,8,16] [--replicas 1,2] [--kills 17] [--prompts 4]
      [--max-new-tokens 48] [--drafter eagle]
Writes scale.json, scale.md and scale.png under --out (default bench/results/scale).
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
from tqdm import tqdm

from bench.common import cell, clients_figure, environment, median, run_clients, save_results
from bench.serve import Recording, Replay, record, replay
from client.loop.decode import Settings, generate
from client.net.remote import RemoteVerifier
from client.training.datasets import mtbench_questions
from server.limits import ServerLimits
from shared.channel import ROUTE_KEY
from shared.engine.models import DEFAULT_MODEL, encode_prompt, load_target, resolve_model
from shared.server_process import ServerChild, pin_process
from shared.wire import splitspec_pb2 as pb
from shared.wire import splitspec_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parent.parent
OVERHEAD_CALLS = 200
PROBE_THREADS, PROBE_CALLS = 16, 40  # Probe calls per thread
HUNG_AFTER_S = 60.0  # a kill round's client still running this long after the replica is back never returned


@dataclass
class Point:
    setup: str
    clients: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    verify_p50_ms: float | None
    verify_p99_ms: float | None
    misses: int | None  # session calls routed to a replica without the session (None: one server)
    exact: bool
    reopens: int | None = None  # sessions the clients reopened (None: one server)


@dataclass
class Overhead:
    setup: str
    probe_p50_ms: float  # one client's sequential Probe (no compute: the call's transport and routing alone)
    probe_p99_ms: float
    verify_p50_ms: float  # one client's sequential one-node Verify (the same forward every call)
    verify_p99_ms: float
    probe_calls_per_s: float  # PROBE_THREADS threads at once


@dataclass
class Kill:
    round: int
    replica: str
    exact: bool
    disconnects: int  # client 0's
    off_server_s: float  # client 0: from the failed call to its reopened session settling (offline generation between)
    replaced_s: float  # from the kill until Serve reports both replicas running again
    wall_s: float  # the round's, all clients
    after_back_s: float | None = None  # the last client's end after the replica was back (None: one never returned)
    returned: int = 0  # clients that returned


def percentile(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1) if ordered else None


def load_point(address: str, setup: str, n: int, recordings: list[Recording], misses, loop: bool = False) -> Point:
    """N replaying clients at once; ``misses()``: the route misses so far (None for one server). ``loop``: each client
    is the decode loop (replaying, default resilience), which survives a miss by reopening its session, instead of
    bare calls (the Verify latencies are then not collected)."""
    channels = [grpc.insecure_channel(address) for _ in range(n)]
    results, latencies, barrier, reopens = [None] * n, [], threading.Barrier(n), []
    before = misses()

    def client(i: int) -> None:
        barrier.wait()
        rec = recordings[i % len(recordings)]
        if loop:
            verifier, start = RemoteVerifier(address), time.perf_counter()
            gen = generate(
                verifier, Replay(rec), rec.prompt, len(rec.tokens),
                Settings(stop_ids=[], max_tree_nodes=16),
            )
            verifier.shutdown()
            results[i] = gen.token_ids, time.perf_counter() - start
            reopens.append(gen.stats.disconnects)
            return
        route = ((ROUTE_KEY, secrets.token_hex(8)),)
        results[i] = replay(pb_grpc.SplitSpecStub(channels[i]), rec, latencies, route, reopens)

    wall = run_clients(client, n)
    for c in channels:
        c.close()
    wanted = [recordings[i % len(recordings)].tokens for i in range(n)]
    tokens = sum(len(w) for w in wanted)
    exact = all(r[0][: len(w)] == w for r, w in zip(results, wanted, strict=True))
    after = misses()
    return Point(setup, n, tokens, round(wall, 3), round(tokens / wall, 2), percentile(latencies, 0.5),
                 percentile(latencies, 0.99), None if after is None else after - before, exact,
                 sum(reopens) if after is not None else None)  # fmt: skip


def overhead(address: str, setup: str, rec: Recording) -> Overhead:
    """One client's sequential Probe calls (nothing computed: what the path itself costs a call) and one-node Verify
    calls (rolled back each time: the same work every call), then Probe calls per second from ``PROBE_THREADS``
    threads."""
    route = ((ROUTE_KEY, secrets.token_hex(8)),)
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.SplitSpecStub(channel)
        opened = stub.OpenSession(pb.OpenSessionRequest(prompt_ids=rec.prompt), timeout=60, metadata=route)
        tree = rec.tree(1).head(1)
        request = pb.VerifyRequest(session_id=opened.session_id, tokens=tree.tokens, parents=tree.parents,
                                   length=opened.length)  # fmt: skip
        latencies, probe_latencies = [], []
        for _ in range(OVERHEAD_CALLS):
            t0 = time.perf_counter()
            stub.Verify(request, timeout=60, metadata=route)
            t1 = time.perf_counter()
            stub.Probe(pb.ProbeRequest(), timeout=60)
            latencies.append(t1 - t0)
            probe_latencies.append(time.perf_counter() - t1)
        stub.CloseSession(pb.CloseSessionRequest(session_id=opened.session_id), timeout=60, metadata=route)

        def probes() -> None:
            for _ in range(PROBE_CALLS):
                stub.Probe(pb.ProbeRequest(), timeout=60)

        rate = PROBE_THREADS * PROBE_CALLS / run_clients(lambda i: probes(), PROBE_THREADS)
    return Overhead(setup, percentile(probe_latencies, 0.5), percentile(probe_latencies, 0.99),
                    percentile(latencies, 0.5), percentile(latencies, 0.99), round(rate, 1))  # fmt: skip


def route_misses() -> int:
    """Every live replica's count of session calls that found no session there."""
    from server import cluster

    return sum(f["misses"] for f in cluster.figures())


def kill_round(address: str, round_no: int, recordings: list[Recording], clients: int) -> Kill:
    """``clients`` decode loops replaying; the replica of client 0's session killed before its third Verify. The
    clients are waited for only so long after the replica is back: one that hangs is reported, never waited on."""
    from server import cluster
    from server.routing import owner

    results, errors, killed, ended = [None] * clients, [], [], [None] * clients
    kill_done = threading.Event()

    def client(i: int) -> None:
        rec = recordings[i % len(recordings)]
        try:
            verifier = RemoteVerifier(address)
            if i == 0:
                verify, calls = verifier.verify, []

                def verify_and_kill(tree, **kw):
                    calls.append(1)
                    if len(calls) == 3:
                        victim = owner(verifier.connection.route.key, list(cluster.replicas()))
                        cluster.kill(victim)
                        killed.append((victim, time.monotonic()))
                        kill_done.set()
                    return verify(tree, **kw)

                verifier.verify = verify_and_kill
            results[i] = generate(
                verifier, Replay(rec), rec.prompt, len(rec.tokens),
                Settings(stop_ids=[], max_tree_nodes=16),
            )
            verifier.shutdown()
        except Exception as exc:  # noqa: BLE001 - a round with an error is reported as not exact
            errors.append(exc)
            tqdm.write(f"round {round_no}, client {i}: {exc!r}", file=sys.stderr)
        finally:
            ended[i] = time.monotonic()
            if i == 0:
                kill_done.set()  # (a client 0 that ended before its third Verify killed nothing)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    start = time.monotonic()
    for t in threads:
        t.start()
    kill_done.wait(HUNG_AFTER_S)
    for _ in range(300):  # until Serve has noticed the death (or every client is done): at most 30 s
        if cluster.running() < 2 or not any(t.is_alive() for t in threads):
            break
        time.sleep(0.1)
    cluster.wait_running(2, timeout_s=300)
    back = time.monotonic()
    for t in threads:
        t.join(max(0.0, back + HUNG_AFTER_S - time.monotonic()))
    victim, at = killed[0] if killed else ("", back)
    returned = sum(e is not None for e in ended)
    exact = not errors and all(r is not None and r.token_ids == recordings[i % len(recordings)].tokens
                               for i, r in enumerate(results))  # fmt: skip
    first = results[0].stats if results[0] is not None else None
    after = max(0.0, max(e for e in ended if e is not None) - back) if returned == clients else None
    return Kill(round_no, victim, exact and bool(killed), first.disconnects if first else 0,
                round(first.offline_s, 3) if first else 0.0, round(back - at, 2),
                round(max(e for e in ended if e is not None) - start if returned else 0.0, 2),
                None if after is None else round(after, 2), returned)  # fmt: skip


def arithmetic(costs: list[Overhead], tau: float) -> list[str]:
    """How far replicas scale, from what was measured here: each node's proxy caps the calls, hence the tokens."""
    base = next((c for c in costs if c.setup == "serve"), None)
    ray = [c for c in costs if c.setup.startswith("ray")]
    if base is None or not ray:
        return []
    proxy = max(c.probe_calls_per_s for c in ray)
    cost = median([c.probe_p50_ms - base.probe_p50_ms for c in ray])
    return ["", f"Scaling arithmetic. Aggregate tokens/s ≈ min(R × T, P × C × τ): R replicas of batched throughput T "
            f"each (`make bench-serve` measures T; on a GPU a batched forward of a few hundred tokens costs about what "
            f"one does, so T grows with the batch), P proxies (Serve runs one per node), C Verify calls/s one proxy "
            f"passes, τ tokens per call (here {tau:.2f}). Measured here: C ≤ {proxy:.0f} calls/s through Serve's proxy "
            f"(Probe, the cheapest call) against {base.probe_calls_per_s:.0f} for one server's own gRPC, so one node's "
            f"proxy caps the cluster near {proxy * tau:.0f} tok/s on this CPU, and the router adds {cost:+.1f} ms p50 "
            f"to each call (Probe: no compute). On 2 cores the replicas and the proxy share the same CPUs, so the "
            f"aggregate is flat: more replicas only split the cores. On GPUs it scales with replicas until C × τ per "
            f"node: then add nodes (a proxy each) or make fewer, larger calls (deeper trees, server-side Decode "
            f"streams)."]


def markdown(points: list[Point], costs: list[Overhead], kills: list[Kill], args, env: dict, tau: float) -> str:
    lines = [f"# Past one server\n\n`{env['command']}`\n\n{env['date']}, {env['cpu']}. Replayed {args.drafter} "
             f"trees on {args.prompts} MT-Bench prompts, {args.max_new_tokens} tokens per client, greedy; `serve`: one "
             "process on every CPU; `ray×R`: R replicas sharing them.", "",
             "| setup | clients | tok/s (all clients) | Verify p50 ms | Verify p99 ms | route misses | reopens "
             "| exact |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for p in points:
        lines.append(f"| {p.setup} | {p.clients} | {p.tokens_per_s:.1f} | {cell(p.verify_p50_ms, '.1f')} | "
                     f"{cell(p.verify_p99_ms, '.1f')} | {'' if p.misses is None else p.misses} | "
                     f"{'' if p.reopens is None else p.reopens} | {'yes' if p.exact else 'NO'} |")  # fmt: skip
    if costs:
        lines += ["", f"One client, {OVERHEAD_CALLS} sequential Probe calls (nothing computed) and one-node Verify "
                  f"calls (the same forward each time) in turn; Probe calls/s: {PROBE_THREADS} threads × "
                  f"{PROBE_CALLS} calls.", "",
                  "| setup | Probe p50 ms | Probe p99 ms | Verify p50 ms | Verify p99 ms | Probe calls/s |",
                  "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    lines += [f"| {c.setup} | {c.probe_p50_ms:.2f} | {c.probe_p99_ms:.2f} | {c.verify_p50_ms:.2f} | "
              f"{c.verify_p99_ms:.2f} | {c.probe_calls_per_s:.0f} |" for c in costs]  # fmt: skip
    base = next((c for c in costs if c.setup == "serve"), None)
    for c in costs:
        if base is not None and c is not base:
            lines.append(f"\nRouter cost per call ({c.setup}, Probe p50 against one server's): "
                         f"{c.probe_p50_ms - base.probe_p50_ms:+.2f} ms.")
    if any(p.reopens is not None for p in points):
        lines += ["", "`reopens`: bare-call clients reopen a session the server answers NOT_FOUND for from the prompt "
                  "and the tokens so far, as the split client does; decode-loop clients (replaying, default "
                  "resilience) "
                  "count every disconnect, including calls the heartbeat abandoned as overdue (Serve's own router "
                  "holds a call back for up to 1-2 s while it waits to learn which replica holds its key). Verify "
                  "latencies are not collected for decode-loop clients."]
    lines += arithmetic(costs, tau)
    if kills:
        off = [k.off_server_s for k in kills]
        back = [k.replaced_s for k in kills]
        waits = [k.after_back_s for k in kills if k.after_back_s is not None]
        hung = sum(args.kill_clients - k.returned for k in kills)
        pinned = f", everything pinned to CPU {args.pin}" if args.pin else ""
        lines += ["", f"Replica kills: {len(kills)} rounds of {args.kill_clients} clients on ray×2{pinned}, "
                  f"{sum(k.exact for k in kills)}/{len(kills)} rounds with every output equal to the recording; "
                  f"{hung} generations never returned (none waited on past {HUNG_AFTER_S:.0f} s after the replica was "
                  f"back); client 0 off its server median {median(off):.2f} s (max {max(off):.2f}); "
                  f"replica back in median {median(back):.1f} s (max {max(back):.1f}); the last client's end after "
                  f"the replica was back: median {cell(median(waits), '.2f')} s, **longest "
                  f"{cell(max(waits, default=None), '.2f')} s** (its remaining tokens included).", "",
                  "| round | replica killed | exact | returned | disconnects | off server s | replaced s | "
                  "last client after back s | round wall s |",
                  "|---:|---|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        lines += [f"| {k.round} | {k.replica} | {'yes' if k.exact else 'NO'} | {k.returned}/{args.kill_clients} | "
                  f"{k.disconnects} | {k.off_server_s:.2f} | {k.replaced_s:.1f} | "
                  f"{'never' if k.after_back_s is None else f'{k.after_back_s:.2f}'} | {k.wall_s:.1f} |"
                  for k in kills]  # fmt: skip
    return "\n".join(lines)


def figure(points: list[Point], out: Path) -> None:
    series = {}
    for setup in dict.fromkeys(p.setup for p in points):
        ps = [p for p in points if p.setup == setup]
        series[setup] = ([p.clients for p in ps], [p.tokens_per_s for p in ps], [p.verify_p99_ms for p in ps])
    clients_figure(series, "tokens/s, all clients", "Verify p99 latency, ms", out / "scale.png",
                   "one server vs Ray Serve replicas")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", default="1,2,4,8,16", help="comma list of concurrent client counts")
    p.add_argument("--replicas", default="1,2", help="comma list of replica counts")
    p.add_argument("--kills", type=int, default=17, help="replica-kill rounds on 2 replicas (default 17; 0: none)")
    p.add_argument("--kill-clients", type=int, default=4, help="clients in each kill round (default 4)")
    p.add_argument("--pin", default="", help="CPUs (comma list) for this process, Ray and the replicas (default: all); "
                   "0 puts clients and replicas on one core, as on a loaded slow machine")
    p.add_argument("--prompts", type=int, default=4, help="MT-Bench prompts to record trees on (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="tokens per client (default 48)")
    p.add_argument("--drafter", default="eagle", help="whose trees to replay (default eagle)")
    p.add_argument("--router", default="session", choices=["session", "serve"],
                   help="how the replicas are routed to (default session: strict affinity; serve: Serve's own)")
    p.add_argument("--no-serve", action="store_true", help="skip the one-server rows")
    p.add_argument("--decode-loop", action="store_true", help="the replicas' clients run the decode loop (replaying, "
                   "default resilience, heartbeat) instead of bare calls")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "scale")
    args = p.parse_args(argv)
    counts = [int(c) for c in args.clients.split(",")]
    replica_counts = [int(r) for r in args.replicas.split(",")]
    if args.pin:
        pin_process({int(c) for c in args.pin.split(",")})  # Ray's processes, started later, inherit the set
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

    target = load_target(args.model, dtype="auto")
    questions = mtbench_questions()[: args.prompts]
    prompts = [encode_prompt(target.tokenizer, q["turns"][0], chat=True) for q in questions]
    recordings = record(target, args.drafter, prompts, args.max_new_tokens)
    del target
    limits = ["--max-sessions", str(2 * max(counts + [args.kill_clients]))]
    points, costs, kills = [], [], []

    if not args.no_serve:
        with tempfile.TemporaryDirectory(prefix="splitspec-scale-") as workdir:  # one server, Ray not started yet
            child = ServerChild(["--model", args.model, "--threads", str(cpus), *limits], Path(workdir))
            child.start()
            try:
                costs.append(overhead(child.address, "serve", recordings[0]))
                for n in tqdm(counts, desc="serve", unit="N", file=sys.stderr):
                    points.append(load_point(child.address, "serve", n, recordings, lambda: None))
                    tqdm.write(str(points[-1]), file=sys.stderr)
            finally:
                child.stop()

    import ray
    from ray import serve

    from server import cluster

    os.environ.update(cluster.ray_environment())
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    port = cluster.free_port()
    try:
        resolve_model(args.model)
        for r in replica_counts:
            config = cluster.ReplicaConfig(model=args.model, threads=max(1, cpus // r),
                                           limits=ServerLimits(max_sessions=int(limits[1])).as_dict())  # fmt: skip
            cluster.deploy(config, r, port, router=args.router)
            loop = args.decode_loop
            setup = f"ray×{r}" + ("" if args.router == "session" else f", {args.router} router") + (
                ", decode loop" if loop else "")
            address = f"127.0.0.1:{port}"
            if not loop and args.router == "session":  # sequential calls that a miss would end
                costs.append(overhead(address, setup, recordings[0]))
            for n in tqdm(counts, desc=setup, unit="N", file=sys.stderr):
                points.append(load_point(address, setup, n, recordings, route_misses, loop))
                tqdm.write(str(points[-1]), file=sys.stderr)
            if r == 2 and args.kills:
                for k in tqdm(range(args.kills), desc="replica kills", unit="kill", file=sys.stderr):
                    kills.append(kill_round(address, k, recordings, args.kill_clients))
                    tqdm.write(str(kills[-1]), file=sys.stderr)
            serve.delete(cluster.APP)
    finally:
        serve.shutdown()
        ray.shutdown()

    tau = sum(len(r.tokens) - 1 for r in recordings) / max(1, sum(r.rounds() for r in recordings))
    md = markdown(points, costs, kills, args, environment(cpus), tau)
    print(md)
    result = {"environment": environment(cpus), "args": vars(args) | {"out": str(args.out)},
              "points": [asdict(p) for p in points], "overhead": [asdict(c) for c in costs],
              "kills": [asdict(k) for k in kills]}  # fmt: skip
    save_results(args.out, "scale", result, md)
    figure(points, args.out)
    print(f"\nwrote {args.out}/scale.{{json,md,png}}", file=sys.stderr)
    return 0 if all(p.exact for p in points) and all(k.exact for k in kills) else 1


if __name__ == "__main__":
    sys.exit(main())
