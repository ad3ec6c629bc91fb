"""`splitspec netsim`: serve the Toxiproxy API, or drive one (ours or a real toxiproxy-server).

splitspec netsim serve [--host 127.0.0.1] [--port 8474]
splitspec netsim apply --proxy NAME --profile 4g [--upstream HOST:PORT]
splitspec netsim cut [--silent]|restore --proxy NAME
splitspec netsim status
splitspec netsim device --profile phone|laptop|desktop [--share S] [--check SECONDS] [-- COMMAND...]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time

from netsim.client import DEFAULT_URL, ToxiproxyClient
from netsim.profiles import PROFILES, apply_profile, get_profile
from shared.errors import SplitspecError


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    serve = sub.add_parser("serve", help="serve Toxiproxy's HTTP API and its proxies")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8474, help="API port (default 8474, Toxiproxy's)")

    url = argparse.ArgumentParser(add_help=False)
    url.add_argument(
        "--url", default=os.environ.get("TOXIPROXY_URL", DEFAULT_URL), help="the API (default $TOXIPROXY_URL or :8474)"
    )
    proxy = argparse.ArgumentParser(add_help=False, parents=[url])
    proxy.add_argument("--proxy", required=True, help="proxy name")

    apply = sub.add_parser("apply", parents=[proxy], help="give a proxy a network profile")
    apply.add_argument("--profile", required=True, choices=list(PROFILES), help="network conditions")
    apply.add_argument("--upstream", help="create the proxy in front of HOST:PORT if it does not exist")
    apply.add_argument("--listen", default="127.0.0.1:0", help="with --upstream: where the new proxy listens")
    apply.add_argument("--period", type=float, default=10.0, help="flaky: seconds between cuts (default 10)")
    apply.add_argument("--down", type=float, default=2.0, help="flaky: seconds each cut lasts (default 2)")
    apply.add_argument("--duration", type=float, help="flaky: stop flapping after this many seconds")
    cut = sub.add_parser("cut", parents=[proxy], help="take a proxy down: cut live connections, refuse new ones")
    cut.add_argument("--silent", action="store_true",
                     help="drop every byte both ways instead, closing nothing (a fading radio link)")  # fmt: skip
    sub.add_parser("restore", parents=[proxy], help="bring a proxy back up")
    sub.add_parser("status", parents=[url], help="list proxies and their toxics")
    device = sub.add_parser("device", help="run a command with its CPU held to an edge device's share of one core")
    device.add_argument("--profile", default="phone", help="phone, laptop or desktop (default phone)")
    device.add_argument("--share", type=float, help="a share of one core instead of the profile's")
    device.add_argument("--check", type=float, metavar="SECONDS",
                        help="instead of a command: how close a busy loop comes to the share over SECONDS")  # fmt: skip
    device.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="what runs held to the share")


def run(args: argparse.Namespace) -> int:
    if args.action == "serve":
        return _serve(args.host, args.port)
    if args.action == "device":
        return _device(args)
    client = ToxiproxyClient(args.url)
    if args.action == "apply":
        return _apply(client, args)
    if args.action in ("cut", "restore"):
        from netsim.harness import cut_link, restore_link

        if args.action == "cut":
            cut_link(client, args.proxy, args.silent)
        else:
            restore_link(client, args.proxy)
        print(f"{args.proxy}: {'down' if args.action == 'cut' else 'up'}")
        return 0
    _status(client)
    return 0


def _device(args: argparse.Namespace) -> int:
    from netsim.device import get_device, measure, run_limited

    share = args.share if args.share is not None else get_device(args.profile).cpu_share
    command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if args.check is not None:
        got = measure(share, args.check)
        print(f"held to {share:g} of a core by {got['how']}: a busy loop got {got['achieved']:.3f} of a core")
        return 0
    if not command:
        raise SplitspecError("netsim device: give a command after --, or --check SECONDS")
    return run_limited(command, share)


def _serve(host: str, port: int) -> int:
    from netsim.api import serve

    async def main() -> None:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        await serve(host, port, ready=lambda url: print(f"netsim: Toxiproxy API on {url}", flush=True))

    try:
        asyncio.run(main())
    except asyncio.CancelledError:
        pass
    except OSError as exc:
        raise SplitspecError(f"cannot serve the API on {host}:{port}: {exc.strerror or exc}") from None
    return 0


def _apply(client: ToxiproxyClient, args: argparse.Namespace) -> int:
    get_profile(args.profile)
    if args.upstream and args.proxy not in client.proxies():
        created = client.create(args.proxy, args.upstream, listen=args.listen)
        print(f"{args.proxy}: listening on {created['listen']} -> {args.upstream}")
    elif args.proxy not in client.proxies():
        raise SplitspecError(f"no proxy named {args.proxy!r} at {client.url}; pass --upstream HOST:PORT to create it")
    profile = apply_profile(client, args.proxy, args.profile)
    print(f"{args.proxy}: {profile.name}")
    if not profile.flaky:
        return 0
    from netsim.harness import Flapper

    flapper = Flapper(client, args.proxy, args.period, args.down).start()
    print(f"{args.proxy}: cutting for {args.down:g}s every {args.period:g}s; Ctrl-C stops", flush=True)
    try:
        deadline = time.monotonic() + (args.duration if args.duration is not None else float("inf"))
        while time.monotonic() < deadline:
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
    except KeyboardInterrupt:
        pass
    finally:
        flapper.stop()
    print(f"{args.proxy}: {flapper.cuts} cuts, link left up")
    return 0


def _status(client: ToxiproxyClient, out=sys.stdout) -> None:
    version = client.version()
    out.write(f"{client.url}: {version.get('server', 'toxiproxy')} {version.get('version', '?')}\n")
    proxies = client.proxies()
    if not proxies:
        out.write("no proxies\n")
    for name, p in sorted(proxies.items()):
        state = "up" if p["enabled"] else "DOWN"
        out.write(f"{name}: {p['listen']} -> {p['upstream']} [{state}]\n")
        for t in p.get("toxics", []):
            attrs = " ".join(f"{k}={v}" for k, v in t["attributes"].items())
            share = "" if t["toxicity"] == 1 else f" toxicity={t['toxicity']:g}"
            out.write(f"  {t['stream']:<10} {t['type']:<11} {attrs}{share}  ({t['name']})\n")
