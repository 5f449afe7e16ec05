"""The CPU this process really has, and how much of it other processes are using. Torch-free.

``cpu_budget``: the cores in the process's affinity mask, capped by its cgroup's CPU quota (``cpu.max`` in cgroup
v2, ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` in v1): what ``--threads auto`` runs on. A quota of 1.5 CPUs
gives 1 thread: a team that waits at barriers runs at the pace of its slowest member, and a second thread
throttled for a quarter of every period stalls the first with it.

``NeighbourMeter``: over a window, how many of this process's CPUs other processes kept busy (the CPUs' busy
time in ``/proc/stat``, less this process's own CPU time): what the thread governor adapts to.

``native_bf16``: whether the CPU computes in bfloat16 itself (AVX512-BF16, AMX-BF16, Arm's BF16), read from
``/proc/cpuinfo``: what ``--dtype auto`` picks by. A feature, not a timing: every process on one machine (a
cluster's replicas, a restarted server) picks the same dtype and gives the same answers.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
CGROUP_ROOT = Path("/sys/fs/cgroup")


def cpu_budget(
    affinity: set[int] | None = None, cgroup_root: Path = CGROUP_ROOT, proc_cgroup: str | None = None
) -> int:
    """Threads to run: the CPUs in ``affinity`` (this process's, by default), capped by the CPU quota of the cgroup
    ``proc_cgroup`` (the text of ``/proc/self/cgroup``) places it in under ``cgroup_root``; at least 1."""
    cpus = len(affinity if affinity is not None else os.sched_getaffinity(0))
    quota = cgroup_quota(cgroup_root, _read(PROC / "self" / "cgroup") if proc_cgroup is None else proc_cgroup)
    if quota is not None:
        cpus = min(cpus, math.floor(quota))
    return max(cpus, 1)


def cgroup_quota(root: Path, proc_cgroup: str) -> float | None:
    """The CPU quota, in CPUs, of the cgroup (and each of its ancestors: the tightest wins) that ``proc_cgroup``
    names; None when there is none."""
    quotas: list[float] = []
    for line in proc_cgroup.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # cgroup v2: one unified hierarchy
            quotas += [q for d in _ancestors(root, path) if (q := _v2_quota(d)) is not None]
        elif "cpu" in controllers.split(","):  # cgroup v1: the cpu controller's own hierarchy
            base = next((root / name for name in ("cpu", "cpu,cpuacct", "cpuacct,cpu") if (root / name).is_dir()), None)
            if base is not None:
                quotas += [q for d in _ancestors(base, path) if (q := _v1_quota(d)) is not None]
    return min(quotas) if quotas else None


def _ancestors(base: Path, path: str) -> list[Path]:
    """``base/path`` and every directory above it up to ``base``: limits set higher up apply too."""
    parts = [p for p in path.split("/") if p]
    return [base.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def _v2_quota(directory: Path) -> float | None:
    fields = _read(directory / "cpu.max").split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    return int(fields[0]) / int(fields[1])


def _v1_quota(directory: Path) -> float | None:
    quota, period = _read(directory / "cpu.cfs_quota_us").strip(), _read(directory / "cpu.cfs_period_us").strip()
    if not quota or not period or int(quota) <= 0:
        return None
    return int(quota) / int(period)


#: The ``/proc/cpuinfo`` flags of a CPU that multiplies bfloat16 natively (x86: ``flags``; Arm: ``Features``).
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The first processor's feature flags in ``/proc/cpuinfo``'s text."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU (or the one ``cpuinfo`` describes) has bfloat16 arithmetic in hardware."""
    text = _read(PROC / "cpuinfo") if cpuinfo is None else cpuinfo
    return bool(cpu_flags(text) & BF16_FLAGS)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


@dataclass(slots=True)
class _Reading:
    wall: float
    busy_ticks: int  # busy time of this process's CPUs, all processes
    own_ticks: int  # this process's CPU time


class NeighbourMeter:
    """How many CPUs' worth of time other processes took on this process's CPUs since the last ``sample``.

    Both readings are in the kernel's clock ticks (``/proc/stat`` and ``/proc/self/stat`` share ``USER_HZ``);
    a CPU's busy time counts everything but idle and iowait, so a hypervisor's steal counts as a neighbour too.
    """

    def __init__(
        self, cpus: set[int] | None = None, proc: Path = PROC, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._cpus = cpus if cpus is not None else os.sched_getaffinity(0)
        self._proc = proc
        self._clock = clock
        self._hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._last = self._read()

    def sample(self) -> float | None:
        """Other processes' busy CPUs since the last call (e.g. 1.0: one core kept busy); None when unreadable."""
        now = self._read()
        last, self._last = self._last, now
        if now is None or last is None or now.wall <= last.wall:
            return None
        others = (now.busy_ticks - last.busy_ticks) - (now.own_ticks - last.own_ticks)
        return max(others / self._hz / (now.wall - last.wall), 0.0)

    def _read(self) -> _Reading | None:
        stat, own = _read(self._proc / "stat"), _read(self._proc / "self" / "stat")
        busy = 0
        found = False
        for line in stat.splitlines():
            name, *values = line.split()
            if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in self._cpus:
                continue
            ticks = [int(v) for v in values]
            busy += sum(ticks[:8]) - ticks[3] - ticks[4]  # user..steal, less idle and iowait
            found = True
        fields = own.rpartition(")")[2].split()  # after the command name, which may hold spaces
        if not found or len(fields) < 13:
            return None
        return _Reading(self._clock(), busy, int(fields[11]) + int(fields[12]))  # utime + stime
