"""`splitspec demo`: the whole system in one command, on loopback.

Starts `splitspec serve` as a child process, waits until it answers, streams a chat reply
drafted by prompt lookup and verified by the server, prints a stats line, and always stops
the server (also on Ctrl-C).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from shared.errors import SplitspecError
from shared.models import DEFAULT_MODEL

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


class ServerChild:
    """A `splitspec serve` child process on loopback that can be started, killed and started again.

    Its log goes to a file, not a pipe: nobody reads a pipe, and a full one stalls the server.
    ``port=0`` lets the first start pick a free port; later starts reuse it (a restart, as clients see one).
    """

    def __init__(self, serve_args: list[str], workdir: Path, port: int = 0, timeout_s: float = 300.0):
        self.serve_args, self.workdir, self.port, self.timeout_s = list(serve_args), Path(workdir), port, timeout_s
        self.process: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> str:
        """Start the server and wait until it listens; returns its address."""
        ready, log = self.workdir / "port", self.workdir / "server.log"
        ready.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "shared.cli", "serve", "--port", str(self.port), "--ready-file", str(ready),
               *self.serve_args]  # fmt: skip
        with open(log, "a") as log_file:
            self.process = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.timeout_s
        while not ready.exists():
            if self.process.poll() is not None:
                tail = "\n".join(log.read_text().strip().splitlines()[-10:])
                raise SplitspecError(f"the server exited with code {self.process.returncode}:\n{tail}")
            if time.monotonic() > deadline:
                self.stop()
                raise SplitspecError(f"the server did not become ready within {self.timeout_s:g}s (log: {log})")
            time.sleep(0.05)
        self.port = int(ready.read_text())
        return self.address

    def kill(self) -> None:
        """SIGKILL: the server vanishes with its sessions, as in a crash."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


@contextmanager
def server_child(serve_args: list[str], workdir: Path, timeout_s: float = 300.0) -> Iterator[str]:
    """A `splitspec serve` child on a free loopback port: yields its address, always stops it."""
    child = ServerChild(serve_args, workdir, timeout_s=timeout_s)
    try:
        yield child.start()
    finally:
        child.stop()


def run(args: argparse.Namespace) -> int:
    from client.cli import TextStream, stats_line
    from client.decode import speculative_generate
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
        gen = speculative_generate(
            remote,
            make_drafter(args.drafter),
            encode_prompt(tokenizer, args.prompt, True),
            args.max_new_tokens,
            on_tokens=TextStream(tokenizer),
        )
        remote.shutdown()
        print()
        print(stats_line(gen), file=sys.stderr)
    return 0
