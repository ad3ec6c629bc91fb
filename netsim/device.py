"""Edge devices as they are: a client's CPU held to a share of one core, beside the link profiles.

The deployment drafts on phones and laptops, whose cores run a draft step several times slower than one core of
these machines. A device profile holds the client's process (and what it starts) to a share of one core, with
whatever this kernel allows, in this order:

* cgroup v2: a child group with ``cpu.max`` (quota per period), where the cpu controller is delegated;
* cgroup v1: a group under ``/sys/fs/cgroup/cpu`` with ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``;
* a duty cycle: the process group stopped and continued (SIGSTOP / SIGCONT), its CPU time kept to the share.

Each says which it used (``CpuLimit.how``), and ``measure`` says how close a busy process comes to the share.

Run:  splitspec netsim device --profile phone -- COMMAND...      (the command held to the profile's share)
      splitspec netsim device --share 0.3 --check 3               (how close a busy loop comes, 3 s)
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from shared.errors import SplitspecError

CGROUP = Path("/sys/fs/cgroup")
PERIOD_S = 0.02  # a short period: a quota of a few ms a period keeps the client's steps evenly slowed, not bursty


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    cpu_share: float  # of one core of the machine the client runs on
    about: str


# Shares of one server core (the kinds here: Zen 3 to Zen 5, Sapphire Rapids). DESIGN.md §5: a phone- or laptop-class
# CPU runs a 0.5B draft step several times slower than one Zen 5 core; these are assumptions, stated as such.
DEVICES: dict[str, DeviceProfile] = {
    "phone": DeviceProfile("phone", 0.25, "a phone-class core: a quarter of one server core"),
    "laptop": DeviceProfile("laptop", 0.5, "a laptop-class core on battery: half of one server core"),
    "desktop": DeviceProfile("desktop", 1.0, "a desktop-class core: one server core"),
}


def get_device(name: str) -> DeviceProfile:
    if name not in DEVICES:
        raise SplitspecError(f"unknown device profile {name!r}; expected one of {', '.join(DEVICES)}")
    return DEVICES[name]


def _write(path: Path, text: str) -> None:
    path.write_text(text)


def _cgroup_of(pid: int, controller: str) -> str | None:
    """The group ``pid`` is in: on the v1 hierarchy of ``controller``, or on v2's (``controller`` "")."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers.split(",").count(controller):
            return path
    return None


class CpuLimit:
    """Hold process ``pid`` (with its threads, and with a cgroup what it starts later; with a duty cycle its process
    group) to ``share`` of one core while the block runs. ``how`` says which mechanism took it."""

    def __init__(self, pid: int, share: float, period_s: float = PERIOD_S, root: Path = CGROUP) -> None:
        if not 0 < share <= 64:
            raise SplitspecError(f"a CPU share of {share}; expected a share of one core in (0, 64]")
        self.pid, self.share, self.period_s, self.root = pid, share, period_s, root
        self.how = ""
        self._group: Path | None = None
        self._home: Path | None = None  # v1: the group the process came from
        self._cycler: subprocess.Popen | None = None  # the duty cycle's process

    def __enter__(self) -> CpuLimit:
        period_us = int(self.period_s * 1e6)
        quota_us = max(1000, int(self.share * period_us))  # the kernel's smallest quota is 1 ms
        for attempt in (self._cgroup_v2, self._cgroup_v1):
            try:
                if attempt(quota_us, period_us):
                    return self
            except OSError:
                self._remove_group()
        # a process of its own (a session of its own too): it can stop this one, and goes on if this one is stopped
        whole = "group" if self.pid != os.getpid() else "process"
        self._cycler = subprocess.Popen([sys.executable, "-m", "netsim.device", str(self.pid), str(self.share),
                                         str(self.period_s), whole], start_new_session=True)  # fmt: skip
        self.how = f"a duty cycle: the {whole} stopped and continued, checked every {self.period_s * 100:g} ms"
        return self

    def __exit__(self, *exc) -> None:
        if self._cycler is not None:
            self._cycler.terminate()  # it continues what it stopped as it goes
            self._cycler.wait()
        if self._group is not None:
            try:
                if self._home is not None:
                    _write(self._home / "cgroup.procs", str(self.pid))
            except OSError:
                pass  # the process has ended
            self._remove_group()

    def _cgroup_v2(self, quota_us: int, period_us: int) -> bool:
        if not (self.root / "cgroup.controllers").is_file():
            return False
        here = _cgroup_of(self.pid, "")
        if here is None:
            return False
        parent = self.root / here.lstrip("/")
        if "cpu" not in (parent / "cgroup.subtree_control").read_text().split():
            return False
        self._group = parent / f"splitspec-device-{self.pid}"
        self._group.mkdir(exist_ok=True)
        self._home = parent
        _write(self._group / "cpu.max", f"{quota_us} {period_us}")
        _write(self._group / "cgroup.procs", str(self.pid))
        self.how = f"cgroup v2: cpu.max {quota_us} {period_us}"
        return True

    def _cgroup_v1(self, quota_us: int, period_us: int) -> bool:
        controller = self.root / "cpu"
        if not (controller / "cpu.cfs_quota_us").is_file():
            return False
        self._home = controller / (_cgroup_of(self.pid, "cpu") or "/").lstrip("/")
        self._group = controller / f"splitspec-device-{self.pid}"
        self._group.mkdir(exist_ok=True)
        _write(self._group / "cpu.cfs_period_us", str(period_us))
        _write(self._group / "cpu.cfs_quota_us", str(quota_us))
        _write(self._group / "cgroup.procs", str(self.pid))
        self.how = f"cgroup v1: cpu.cfs_quota_us {quota_us} of cpu.cfs_period_us {period_us}"
        return True

    def _remove_group(self) -> None:
        if self._group is not None:
            try:
                self._group.rmdir()
            except OSError:
                pass
            self._group = None


def cycle(pid: int, share: float, period_s: float, whole: str) -> None:
    """The duty cycle, closed loop, a check every tenth of a period: ``pid`` (its process group with ``whole`` =
    "group") runs while its threads' CPU time (schedstat's nanoseconds) is below ``share`` of the wall time since
    the cycle began, else it is stopped; continued when the cycle ends (SIGTERM) or ``pid`` is gone. Open-loop
    sleeps overshoot: a 5 ms run per 20 ms gave a busy loop 0.36 of a core, not 0.25."""
    send = (lambda sig: os.killpg(os.getpgid(pid), sig)) if whole == "group" else (lambda sig: os.kill(pid, sig))
    ending = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: ending.set())
    start, base, running = time.monotonic(), run_ns(pid), True
    try:
        while not ending.is_set():
            over = run_ns(pid) - base > share * (time.monotonic() - start) * 1e9
            if over == running:
                send(signal.SIGSTOP if running else signal.SIGCONT)
                running = not running
            ending.wait(period_s / 10)
    except (ProcessLookupError, FileNotFoundError):
        return
    finally:
        with contextlib.suppress(ProcessLookupError):
            send(signal.SIGCONT)


def run_ns(pid: int) -> int:
    """Nanoseconds process ``pid``'s threads have run (schedstat: finer than the clock ticks of /proc/PID/stat)."""
    return sum(int((task / "schedstat").read_text().split()[0]) for task in Path(f"/proc/{pid}/task").iterdir())


def measure(share: float, seconds: float = 3.0, period_s: float = PERIOD_S, root: Path = CGROUP) -> dict:
    """How close a busy process held to ``share`` comes to it: {how, share, achieved} (CPU seconds over wall
    seconds of a one-thread busy loop, measured over ``seconds``)."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    try:
        with CpuLimit(busy.pid, share, period_s, root) as limit:
            time.sleep(min(0.2, seconds / 5))  # settled into the limit
            cpu0, wall0 = run_ns(busy.pid), time.monotonic()
            time.sleep(seconds)
            cpu1, wall1 = run_ns(busy.pid), time.monotonic()
        return {"how": limit.how, "share": share, "achieved": (cpu1 - cpu0) / 1e9 / (wall1 - wall0)}
    finally:
        os.killpg(busy.pid, signal.SIGKILL)
        busy.wait()


def run_limited(command: list[str], share: float) -> int:
    """Run ``command`` held to ``share`` of one core; its exit status."""
    child = subprocess.Popen(command, start_new_session=True)
    with CpuLimit(child.pid, share) as limit:
        print(f"splitspec device: {command[0]} held to {share:g} of a core ({limit.how})", file=sys.stderr)
        try:
            return child.wait()
        except KeyboardInterrupt:
            os.killpg(child.pid, signal.SIGINT)
            return child.wait()


if __name__ == "__main__":  # the duty cycle's own process: PID SHARE PERIOD_S group|process
    cycle(int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), sys.argv[4])
