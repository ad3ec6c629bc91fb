"""`splitspec serve`: host the target model over gRPC."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading

from shared.models import DEFAULT_MODEL, DTYPES


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
        help="weights and activations: auto (default) = bf16 where the hardware computes it, else float32"
    )
    p.add_argument("--weights", default="native", choices=["native", "int8"],
                   help="native, or int8 weight-only projections: a different served target (lossless relative to "
                        "itself), about twice as fast per token on a CPU, no faster for big trees")  # fmt: skip
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--max-sessions", type=int, default=16, help="concurrent sessions (default 16)")
    p.add_argument("--max-tree-nodes", type=int, default=128, help="draft tree nodes per verification (default 128)")
    p.add_argument("--max-context", type=int, default=4096, help="tokens per session, prompt included (default 4096)")
    p.add_argument("--max-new-tokens", type=int, default=4096, help="tokens per Generate call (default 4096)")
    p.add_argument("--session-ttl", type=float, default=600.0, help="seconds an idle session is kept (default 600)")
    p.add_argument(
        "--max-probe-bytes", type=int, default=16 * 1024 * 1024, help="reply bytes per Probe call (default 16 MiB)"
    )
    p.add_argument(
        "--max-inline-payload",
        type=int,
        default=1024 * 1024,
        help="payload bytes carried inside a reply; more is streamed by FetchPayload (default 1 MiB)",
    )
    p.add_argument(
        "--bundle-dir",
        action="append",
        help="folder of drafter bundles whose LSA clients may ask the server to run (payload mode lsa); "
        "repeatable (default: the shipped client/drafters/bundles)",
    )
    p.add_argument("--ready-file", help="write the bound port here once serving (for scripts)")


def run(args: argparse.Namespace) -> int:
    import torch

    from server.service import ServerLimits, build_server
    from shared.models import load_target

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    names = ("max_sessions", "max_tree_nodes", "max_context", "max_new_tokens", "max_probe_bytes", "max_inline_payload")
    for name in names:
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    target = load_target(args.model, device=args.device, dtype=args.dtype, cache=args.cache_dir,
                         weights=args.weights)
    limits = ServerLimits(
        args.max_sessions,
        args.max_tree_nodes,
        args.max_context,
        args.max_new_tokens,
        args.session_ttl,
        args.max_probe_bytes,
        args.max_inline_payload,
    )
    from shared.bundles import SHIPPED

    bundle_dirs = tuple(args.bundle_dir or (SHIPPED,))
    server, port, service = build_server(target, args.host, args.port, limits, bundle_dirs)
    server.start()
    stopped = threading.Event()

    def stop(signum, frame):
        stopped.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(
        f"splitspec: serving {target.name} on {args.host}:{port} ({target.device}, {str(target.dtype)[6:]}, "
        f"context {service.limits.max_context}, {limits.max_sessions} sessions)",
        flush=True,
    )
    if args.ready_file:  # written then renamed, so a reader never sees it half-written
        with open(args.ready_file + ".tmp", "w") as f:
            f.write(f"{port}\n")
        os.replace(args.ready_file + ".tmp", args.ready_file)
    stopped.wait()
    server.stop(grace=2).wait()
    return 0
