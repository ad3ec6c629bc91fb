"""`splitspec serve`: host the target model over gRPC."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading

from server.limits import ServerLimits
from shared.engine.decoder import DTYPES
from shared.engine.models import DEFAULT_MODEL


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"built-in name, HF folder or hub id (default {DEFAULT_MODEL})"
    )
    p.add_argument(
        "--cache-dir", help="where converted models are kept (default $SPLITSPEC_CACHE or ~/.cache/splitspec)"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=50051, help="port to listen on; 0 picks a free one (default 50051)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument(
        "--dtype", default="auto", choices=["auto", *sorted(DTYPES)],
        help="activations (and native weights): auto (default, with --weights auto) = the one path this model is "
             "served on on this machine, the same as `generate --local` with any drafter (`splitspec kernels`); "
             "float32 + native weights gives transformers' own greedy output"
    )
    p.add_argument("--weights", default="auto", choices=["auto", "native", "int8", "int4"],
                   help="auto (default: measured with --dtype auto; native with a pinned dtype), native, or int8/int4 "
                        "on splitspec's CPU kernels with per-token int8 activations: a different served target, "
                        "lossless relative to itself")  # fmt: skip
    p.add_argument("--cuda-graphs", action="store_true",
                   help="run forwards of up to 512 rows on CUDA graphs, captured per row bucket (CUDA only; exact and "
                        "3.3x faster a forward on an H200: docs/engine.md)")
    p.add_argument("--prefer", default="auto", choices=["auto", "latency", "capacity"],
                   help="what replies ask clients to spend: latency (the server decodes for them when that is "
                        "faster), capacity (they draft at the edge to spare its compute), auto: capacity while "
                        "its forwards are compute-bound (default auto)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    ServerLimits.add_arguments(p)
    p.add_argument(
        "--bundle-dir",
        action="append",
        help="folder of drafter bundles whose LSA clients may ask the server to run (payload form lsa); "
        "repeatable (default: the shipped client/drafters/bundles)",
    )
    p.add_argument("--tls-cert", help="serve TLS with this PEM certificate (and --tls-key)")
    p.add_argument("--tls-key", help="the PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", help="mutual TLS: clients must present a certificate this PEM CA signed")
    p.add_argument("--auth-token-file", help="bearer tokens a client must present, one per line (TOKEN or NAME TOKEN); "
                   "a session belongs to the token that opened it")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this HTTP port (0: a free one; "
                   "default: none)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address of the metrics port (default 127.0.0.1)")
    p.add_argument("--ready-file", help="write the bound port here once serving (for scripts)")
    g = p.add_argument_group("cluster (pip install splitspec[ray])")
    g.add_argument("--ray", action="store_true", help="serve as a Ray Serve application of --replicas replicas "
                   "(each one model, one batcher) behind Serve's gRPC proxy on --port; sessions stay on their "
                   "replica; clients need no change")
    g.add_argument("--replicas", type=int, default=2, help="replicas with --ray (default 2)")
    g.add_argument("--ray-address", help="join this Ray cluster (ray://host:10001 or auto) instead of starting one on "
                   "this machine")
    g.add_argument("--router", default="session", choices=["session", "serve"],
                   help="with --ray: session (default; a session's calls go to its replica, strictly) or serve "
                        "(Serve's own best-effort multiplexing: its misses cost the client a reopen)")
    g.add_argument("--replica-cpus", type=float, help="CPUs Ray reserves per replica (default: --threads, else this "
                   "machine's CPUs / --replicas)")
    g.add_argument("--replica-gpus", type=float, help="GPUs per replica (default 1 with --device cuda, else 0)")


def run(args: argparse.Namespace) -> int:
    if args.cuda_graphs and not args.device.startswith("cuda"):
        raise SystemExit(f"--cuda-graphs needs a CUDA device; got --device {args.device}")
    if args.ray:
        return run_cluster(args)
    import torch

    from server.security import server_credentials
    from server.service import build_server
    from shared.auth import read_tokens
    from shared.engine.models import load_target

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        limits = ServerLimits.from_args(args)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    from shared.bundles import SHIPPED

    bundle_dirs = tuple(args.bundle_dir or (SHIPPED,))
    credentials = tokens = None
    if args.tls_cert or args.tls_key or args.tls_client_ca:
        if not (args.tls_cert and args.tls_key):
            raise SystemExit("--tls-cert and --tls-key go together (and --tls-client-ca needs both)")
        credentials = server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca)
    if args.auth_token_file:
        tokens = read_tokens(args.auth_token_file)
    # listening (health: NOT_SERVING, calls: UNAVAILABLE) while the model loads
    server, port, service = build_server(None, args.host, args.port, limits, bundle_dirs, credentials, tokens,
                                         args.prefer)
    server.start()
    stopped = threading.Event()

    def stop(signum, frame):
        stopped.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    if args.metrics_port is not None:
        metrics_server, _ = service.metrics.serve(args.metrics_host, args.metrics_port)
        print(f"splitspec: metrics on http://{args.metrics_host}:{metrics_server.server_port}/metrics", flush=True)
    target = load_target(args.model, device=args.device, dtype=args.dtype, cache=args.cache_dir,
                         weights=args.weights, graphs=args.cuda_graphs)  # fmt: skip
    service.attach(target)
    print(
        f"splitspec: serving {target.name} on {args.host}:{port} ({target.describe()}, "
        f"context {service.limits.max_context}, {limits.max_sessions} sessions)",
        flush=True,
    )
    if args.ready_file:  # written then renamed, so a reader never sees it half-written
        with open(args.ready_file + ".tmp", "w") as f:
            f.write(f"{port}\n")
        os.replace(args.ready_file + ".tmp", args.ready_file)
    stopped.wait()
    server.stop(grace=2).wait()
    service.close()
    return 0


def run_cluster(args: argparse.Namespace) -> int:
    """``serve --ray``: deploy the replicas, wait for them, serve until SIGTERM/SIGINT, then take the application down
    (and the Ray instance, when this command started it)."""
    try:
        import ray
    except ImportError:
        raise SystemExit("--ray needs Ray Serve: pip install 'splitspec[ray]'") from None
    from server import cluster
    from shared.auth import read_tokens
    from shared.bundles import SHIPPED
    from shared.engine.models import resolve_model

    if args.tls_cert or args.tls_key or args.tls_client_ca:
        raise SystemExit("--ray serves through Ray Serve's gRPC proxy, which has no TLS (Ray 2.60): terminate TLS "
                         "in front of it (a gRPC-aware load balancer) or use `splitspec serve` without --ray")
    if args.replicas < 1:
        raise SystemExit(f"--replicas must be >= 1, got {args.replicas}")
    try:
        limits = ServerLimits.from_args(args)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    resolve_model(args.model, args.cache_dir)  # a built-in model is converted once here, not by every replica at once
    cpus = os.cpu_count() or 1
    threads = args.threads or max(1, cpus // args.replicas)
    config = cluster.ReplicaConfig(
        model=args.model, device=args.device, dtype=args.dtype, weights=args.weights, graphs=args.cuda_graphs,
        cache_dir=args.cache_dir,
        threads=threads, limits=limits.as_dict(), bundle_dirs=tuple(str(d) for d in args.bundle_dir or (SHIPPED,)),
        prefer=args.prefer, tokens=read_tokens(args.auth_token_file) if args.auth_token_file else None,
    )  # fmt: skip
    gpus = args.replica_gpus if args.replica_gpus is not None else 1.0 if args.device.startswith("cuda") else 0.0
    os.environ.update(cluster.ray_environment())
    started = args.ray_address is None
    port = args.port or cluster.free_port(args.host)  # Serve's proxy cannot say which port 0 gave it
    if args.metrics_port == 0:
        args.metrics_port = cluster.free_port(args.host)
    extra = {"_metrics_export_port": args.metrics_port} if started and args.metrics_port else {}
    ray.init(address=args.ray_address, include_dashboard=False, logging_level="WARNING", **extra)
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stopped.set())
    signal.signal(signal.SIGINT, lambda signum, frame: stopped.set())
    try:
        cluster.deploy(config, args.replicas, port, args.host, cpus=args.replica_cpus or 0.0, gpus=gpus,
                       router=args.router)  # fmt: skip
        print(f"splitspec: serving {args.model} as {args.replicas} Ray Serve replicas on port {port} "
              f"({threads} threads each, router {args.router})", flush=True)  # fmt: skip
        if not config.tokens:
            print(f"splitspec: note: Serve's gRPC proxy listens on every interface ([::]:{port}), whatever --host "
                  "says; without --auth-token-file anyone who reaches the port may call it", flush=True)
        if args.metrics_port is not None:
            where = f"port {args.metrics_port}" if extra else "the cluster's metrics port"
            print(f"splitspec: metrics (Serve's and each replica's, prefixed ray_) on {where}", flush=True)
        if args.ready_file:
            with open(args.ready_file + ".tmp", "w") as f:
                f.write(f"{port}\n")
            os.replace(args.ready_file + ".tmp", args.ready_file)
        stopped.wait()
    finally:
        from ray import serve

        try:  # a Ctrl-C reaches Ray's own processes too: whatever is left of the cluster, still shut it down
            serve.shutdown() if started else serve.delete(cluster.APP)
        except Exception as exc:  # noqa: BLE001 - reported, and Ray is shut down all the same
            print(f"splitspec: taking the application down: {exc.__class__.__name__}: {exc}", flush=True)
        finally:
            ray.shutdown()
    return 0
