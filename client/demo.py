"""`splitspec demo`: the whole system in one command, on loopback.

Starts `splitspec serve` as a child process, waits until it answers, streams a chat reply
drafted by prompt lookup and verified by the server, prints a stats line, and always stops
the server (also on Ctrl-C).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from shared.models import DEFAULT_MODEL
from shared.server_process import server_child

DEMO_PROMPT = (
    "Write a Python function is_prime(n) that checks whether n is a prime number, "
    "then show how to call it on the numbers 1 to 10."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", default=DEMO_PROMPT, help="chat prompt to run")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"target model (default {DEFAULT_MODEL})")
    p.add_argument("--cache-dir", help="where converted models are kept")
    p.add_argument("--max-new-tokens", type=int, default=160, help="tokens to generate (default 160)")
    p.add_argument("--drafter", default="prompt-lookup", help="drafter to run (default prompt-lookup)")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for the server (default 300)")


def run(args: argparse.Namespace) -> int:
    from client.cli import SettledStream, TextStream, stats_line
    from client.decode import generate
    from client.drafters import make_drafter
    from client.verifiers import RemoteVerifier
    from shared.models import encode_prompt, load_tokenizer
    from shared.target import tokenizer_fingerprint

    tokenizer = load_tokenizer(args.model, args.cache_dir)  # converts the built-in target once, if needed
    serve_args = ["--model", args.model] + (["--cache-dir", args.cache_dir] if args.cache_dir else [])
    print(f"splitspec demo: starting the server ({args.model}) ...", file=sys.stderr, flush=True)
    with (
        tempfile.TemporaryDirectory(prefix="splitspec-demo-") as workdir,
        server_child(serve_args, Path(workdir), args.startup_timeout) as address,
    ):
        remote = RemoteVerifier(address, fingerprint=tokenizer_fingerprint(tokenizer))
        print(f"splitspec demo: server ready at {address}; prompt: {args.prompt}\n", file=sys.stderr, flush=True)
        stream = SettledStream(TextStream(tokenizer), final_local=False)
        gen = generate(remote, make_drafter(args.drafter), encode_prompt(tokenizer, args.prompt, True),
                       args.max_new_tokens, on_update=stream)  # fmt: skip
        stream.finish(gen.token_ids, gen.verified)
        remote.shutdown()
        print()
        print(stats_line(gen), file=sys.stderr)
    return 0
