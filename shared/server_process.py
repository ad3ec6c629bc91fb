"""`splitspec serve` as a child process on loopback: for the demo, the benchmarks and the tests.

Process management only (it imports no server code): the child is started through the CLI, as a
user would, and found ready by the port it writes to ``--ready-file``.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from shared.errors import SplitspecError


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
