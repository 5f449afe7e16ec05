"""The CPU a process really has (affinity mask, cgroup v1 and v2 quotas, read from fixture directories) and the
meter of other processes' use of it (fixture /proc files), and whether it computes in bfloat16 (``--dtype auto``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.core.cpu import NeighbourMeter, cgroup_quota, cpu_budget, native_bf16


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


V2 = "0::/kubepods/pod1/container\n"
V1 = "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n2:cpuset:/docker/abc\n"


def test_a_v2_quota_caps_the_affinity_mask(tmp_path: Path) -> None:
    write(tmp_path / "kubepods/pod1/container/cpu.max", "150000 100000\n")  # 1.5 CPUs
    assert cgroup_quota(tmp_path, V2) == 1.5
    assert cpu_budget({0, 1, 2, 3}, tmp_path, V2) == 1  # rounded down: a throttled team member stalls the team
    write(tmp_path / "kubepods/pod1/container/cpu.max", "300000 100000\n")
    assert cpu_budget({0, 1, 2, 3}, tmp_path, V2) == 3
    assert cpu_budget({0, 1}, tmp_path, V2) == 2  # the affinity mask is the tighter bound


def test_no_quota_leaves_the_affinity_mask(tmp_path: Path) -> None:
    write(tmp_path / "kubepods/pod1/container/cpu.max", "max 100000\n")
    assert cgroup_quota(tmp_path, V2) is None
    assert cpu_budget({0, 1, 2}, tmp_path, V2) == 3
    assert cpu_budget({5}, tmp_path / "nowhere", V2) == 1  # no cgroup files at all
    assert cpu_budget({0, 1}, tmp_path, "") == 2


def test_an_ancestors_quota_applies_and_the_tightest_wins(tmp_path: Path) -> None:
    write(tmp_path / "kubepods/pod1/cpu.max", "100000 100000\n")
    write(tmp_path / "kubepods/pod1/container/cpu.max", "max 100000\n")
    assert cgroup_quota(tmp_path, V2) == 1.0
    write(tmp_path / "kubepods/cpu.max", "50000 100000\n")  # half a CPU: still at least one thread
    assert cpu_budget({0, 1, 2, 3}, tmp_path, V2) == 1


def test_a_v1_cfs_quota(tmp_path: Path) -> None:
    write(tmp_path / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "200000\n")
    write(tmp_path / "cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n")
    assert cgroup_quota(tmp_path, V1) == 2.0
    assert cpu_budget(set(range(8)), tmp_path, V1) == 2
    write(tmp_path / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "-1\n")  # unlimited
    assert cpu_budget(set(range(8)), tmp_path, V1) == 8


def test_this_machine_has_at_least_one_cpu() -> None:
    assert cpu_budget() >= 1


def proc_files(root: Path, cpu_ticks: dict[int, tuple[int, int]], own: tuple[int, int]) -> None:
    """/proc/stat with each CPU's (busy, idle) ticks, and /proc/self/stat with this process's utime, stime."""
    lines = ["cpu  0 0 0 0 0 0 0 0 0 0"]
    for cpu, (busy, idle) in cpu_ticks.items():
        lines.append(f"cpu{cpu} {busy} 0 0 {idle} 0 0 0 0 0 0")
    write(root / "stat", "\n".join(lines) + "\nintr 1 2 3\n")
    fields = ["S", *["0"] * 10, str(own[0]), str(own[1]), *["0"] * 30]
    write(root / "self/stat", f"123 (python -m app) {' '.join(fields)}\n")


def test_the_meter_counts_what_others_used_of_this_process_s_cpus(tmp_path: Path) -> None:
    now = [0.0]
    proc_files(tmp_path, {0: (0, 0), 1: (0, 0), 2: (0, 0)}, (0, 0))
    meter = NeighbourMeter({0, 1}, tmp_path, clock=lambda: now[0])
    hz = meter._hz
    # Over 1 s: CPUs 0 and 1 busy for 1.5 s in all, 0.6 s of it this process's; CPU 2 (not ours) busy throughout.
    proc_files(tmp_path, {0: (hz, 0), 1: (hz // 2, hz // 2), 2: (hz, 0)}, (hz * 4 // 10, hz * 2 // 10))
    now[0] = 1.0
    assert meter.sample() == pytest.approx(0.9, abs=0.02)
    # Nothing else running: only this process's own time.
    proc_files(tmp_path, {0: (2 * hz, 0), 1: (hz, hz)}, (hz, hz * 11 // 10))
    now[0] = 2.0
    assert meter.sample() == pytest.approx(0.0, abs=0.02)


def test_an_unreadable_proc_gives_no_sample(tmp_path: Path) -> None:
    meter = NeighbourMeter({0}, tmp_path / "missing")
    assert meter.sample() is None


def test_the_meter_reads_this_machine() -> None:
    meter = NeighbourMeter()
    sum(range(2_000_000))  # some time passes, some of it this process's
    others = meter.sample()
    assert others is not None and others >= 0


# The first lines of /proc/cpuinfo on the CPU classes this project meets (flags shortened to the ones that matter).
ZEN3 = "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse2 avx avx2 fma f16c\n"
ZEN4 = "processor\t: 0\nmodel name\t: AMD EPYC 9B14\nflags\t\t: avx2 fma avx512f avx512bw avx512_vnni avx512_bf16\n"
SPR = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R)\nflags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
GRAVITON3 = "processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd sve bf16 i8mm\n"


@pytest.mark.parametrize(
    ("cpuinfo", "native"), [(ZEN3, False), (ZEN4, True), (SPR, True), (GRAVITON3, True), ("", False)]
)
def test_bfloat16_is_native_by_the_cpus_flags(cpuinfo: str, native: bool) -> None:
    """``--dtype auto`` picks bfloat16 by this, the same in every process on a machine (a timed choice flipped with
    the load beside it, and a cluster's replicas answered unlike one process)."""
    assert native_bf16(cpuinfo) is native


def test_this_machine_answers_from_its_own_flags() -> None:
    flags = Path("/proc/cpuinfo").read_text()
    assert native_bf16() is native_bf16(flags)
