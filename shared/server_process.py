"""`splitspec serve` as a child process on loopback: for the demo, the benchmarks and the tests.

Process management only (it imports no server code): the child is started through the CLI, as a
user would, and found ready by the port it writes to ``--ready-file``.
"""

from __future__ import annotations

import os
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

    def __init__(self, serve_args: list[str], workdir: Path, port: int = 0, timeout_s: float = 300.0,
                 cpus: set[int] | None = None):  # fmt: skip
        self.serve_args, self.workdir, self.port, self.timeout_s = list(serve_args), Path(workdir), port, timeout_s
        self.cpus = cpus  # the CPUs it may run on (``disjoint_cpus``); None: any
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
        if self.cpus:  # pinned while it is still starting Python: every thread it makes inherits the set
            pin_process(self.cpus, self.process.pid)
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


# For a comparison of one-turn methods on the same prompts against one server: each method's run must prefill its
# prompt as a first turn does, not take it from the prefix cache an earlier method's run left
SINGLE_TURN = ["--prefix-cache-mb", "0"]


@contextmanager
def server_child(serve_args: list[str], workdir: Path, timeout_s: float = 300.0,
                 cpus: set[int] | None = None) -> Iterator[str]:  # fmt: skip
    """A `splitspec serve` child on a free loopback port (on ``cpus`` if given): yields its address, always stops it."""
    child = ServerChild(serve_args, workdir, timeout_s=timeout_s, cpus=cpus)
    try:
        yield child.start()
    finally:
        child.stop()


def disjoint_cpus(server: int, client: int) -> tuple[set[int], set[int]] | None:
    """CPUs for a server child and for this process (the client) that do not overlap: two machines emulated on one,
    so that neither slows the other and a baseline the same child serves gets the same cores. None where this OS
    cannot pin threads or fewer CPUs than ``server + client`` are ours."""
    if not hasattr(os, "sched_getaffinity") or server < 1 or client < 1:
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < server + client:
        return None
    return set(cpus[:server]), set(cpus[server : server + client])


def two_machines(server: int, client: int) -> tuple[set[int], set[int]] | None:
    """``disjoint_cpus``, this process (the client) already pinned to its share (its torch threads are the
    caller's to set); None: the machine is shared, nothing pinned."""
    cpus = disjoint_cpus(server, client)
    if cpus is not None:
        pin_process(cpus[1])
    return cpus


def pin_process(cpus: set[int], pid: int | None = None) -> None:
    """Every thread of process ``pid`` (default: this one) onto ``cpus``; threads it starts later inherit the set.
    (Linux pins per thread: setting the process id alone would leave a running thread pool where it was.)"""
    pid = pid or os.getpid()
    tasks = Path(f"/proc/{pid}/task")
    for tid in [int(t.name) for t in tasks.iterdir()] if tasks.is_dir() else [pid]:
        try:
            os.sched_setaffinity(tid, cpus)
        except (ProcessLookupError, PermissionError):
            pass  # a thread that has just ended


def cpus_label(cpus: tuple[set[int], set[int]] | None) -> str:
    """How the server and the client shared the machine, for every report."""
    if cpus is None:
        return "server child and client sharing the CPUs (too few to give each its own)"
    server, client = (",".join(map(str, sorted(c))) for c in cpus)
    return f"server child pinned to CPU {server}, client to CPU {client} (two machines emulated)"
