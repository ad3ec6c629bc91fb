"""Command-line options every client command shares: how to reach the server and how to use it (`generate`, `edge`)."""

from __future__ import annotations

import argparse
import sys

from netsim.profiles import PROFILES


class Deprecated(argparse.Action):
    """An old flag that still works, for scripts written against earlier versions: it says what replaced it (on
    stderr) and stores its value where the new flag does (``dest``); ``nargs=0`` for an old switch, which stores
    ``const``."""

    def __init__(self, option_strings, dest, *, instead: str, nargs=None, const=None, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=nargs, const=const, help=argparse.SUPPRESS, **kwargs)
        self.instead = instead

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"splitspec: {option_string} is deprecated: {self.instead}", file=sys.stderr)
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)


def add_connection_arguments(p: argparse.ArgumentParser, server_group=None) -> None:
    """--server (in ``server_group`` if given: e.g. exclusive with --local), TLS, token, timeout, --via-netsim."""
    (server_group or p).add_argument(
        "--server", default="127.0.0.1:50051", help="HOST:PORT of `splitspec serve` (default 127.0.0.1:50051)"
    )
    p.add_argument("--tls", action="store_true", help="reach --server over TLS, verified with the system's roots")
    p.add_argument("--tls-ca", help="TLS, verifying the server against this PEM CA")
    p.add_argument("--tls-cert", help="mutual TLS: present this PEM client certificate (with --tls-key)")
    p.add_argument("--tls-key", help="the PEM private key of --tls-cert")
    p.add_argument("--auth-token-file", help="present the (first) bearer token in this file on every call")
    p.add_argument("--connect-timeout", type=float, default=10.0, help="seconds to wait for the server (default 10)")
    p.add_argument(
        "--via-netsim",
        metavar="PROFILE",
        choices=list(PROFILES),
        help=f"reach --server through a netsim proxy with this network profile ({', '.join(PROFILES)})",
    )


def add_mode_argument(p: argparse.ArgumentParser) -> None:
    """--mode: who decodes (``client.loop.adaptive``)."""
    p.add_argument("--mode", default="auto", choices=["auto", "draft", "stream"],
                   help="draft: the drafter proposes and the server verifies every round; stream: the server decodes "
                        "by itself and streams tokens with the drafter's payloads (no round trip per token; offline "
                        "generation takes over on a cut); auto (default): streams, tries drafting between stretches "
                        "and keeps what is faster, and drafts where that spares a busy server compute")  # fmt: skip
