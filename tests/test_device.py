"""netsim.device: an edge device's CPU, a share of one core held by a cgroup or a duty cycle."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from netsim.device import DEVICES, CpuLimit, get_device, measure
from shared.errors import SplitspecError


def test_profiles_are_shares_of_a_core_and_a_wrong_one_is_named():
    assert 0 < DEVICES["phone"].cpu_share < DEVICES["laptop"].cpu_share < DEVICES["desktop"].cpu_share <= 1
    with pytest.raises(SplitspecError, match="expected one of phone, laptop, desktop"):
        get_device("watch")
    with pytest.raises(SplitspecError, match="share of one core"):
        CpuLimit(os.getpid(), 0)


def test_a_cgroup_v1_limit_writes_its_quota_and_takes_the_process_back_after(tmp_path):
    """On a v1 hierarchy (faked here as plain files) the process goes into a group of its own with quota = share x
    period, and back to the group it came from when the block ends."""
    controller = tmp_path / "cpu"
    controller.mkdir()
    for name in ("cpu.cfs_quota_us", "cpu.cfs_period_us", "cgroup.procs"):
        (controller / name).write_text("")
    with CpuLimit(os.getpid(), 0.25, period_s=0.02, root=tmp_path) as limit:
        group = controller / f"splitspec-device-{os.getpid()}"
        assert limit.how.startswith("cgroup v1")
        assert (group / "cpu.cfs_quota_us").read_text() == "5000"
        assert (group / "cpu.cfs_period_us").read_text() == "20000"
        assert (group / "cgroup.procs").read_text() == str(os.getpid())
    home = [ln.split(":", 2)[2] for ln in Path("/proc/self/cgroup").read_text().splitlines()
            if ln.split(":")[1].split(",").count("cpu")] or ["/"]  # fmt: skip
    assert (controller / home[0].lstrip("/") / "cgroup.procs").read_text() == str(os.getpid())


def test_without_a_cgroup_a_process_holds_itself_by_a_duty_cycle_of_its_own(tmp_path):
    """A process with no writable cgroup (a bench's client) is held by a duty cycle in a process of its own, which
    stops and continues it alone (not its process group: the server beside it runs on) and ends with the block."""
    with CpuLimit(os.getpid(), 0.5, root=tmp_path) as limit:
        assert limit.how.startswith("a duty cycle: the process stopped")
        assert sum(range(10**6)) == 499999500000  # it runs, slowed
    assert limit._cycler.poll() is not None


@pytest.mark.timing
@pytest.mark.parametrize("cgroups", [True, False], ids=["this-kernel", "duty-cycle"])
def test_a_busy_process_gets_no_more_than_its_share(tmp_path, cgroups):
    """Whichever mechanism holds it (this kernel's cgroups where writable, else the duty cycle; the duty cycle
    forced), a busy loop gets at most its share of a core, give or take scheduling. (Only the upper bound is
    asserted: a loaded machine gives it less.)"""
    got = measure(0.3, 1.0, root=Path("/sys/fs/cgroup") if cgroups else tmp_path)
    assert got["how"] and got["achieved"] <= 0.3 * 1.25 + 0.05, got
    if not cgroups:
        assert got["how"].startswith("a duty cycle")


def test_a_command_held_to_a_share_runs_to_its_end_and_leaves_no_group(tmp_path):
    out = subprocess.run([sys.executable, "-m", "shared.cli", "netsim", "device", "--share", "0.5", "--",
                          sys.executable, "-c", "print(sum(range(10**5)))"], capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == str(sum(range(10**5))), out.stderr
    assert "held to 0.5 of a core" in out.stderr
    assert not list(Path("/sys/fs/cgroup/cpu").glob("splitspec-device-*"))  # (none where there is no such folder)
