"""The thread team follows the CPUs other processes leave free: it shrinks when a neighbour keeps cores busy,
grows back when it leaves, and does not flap on a one-window burst."""

from __future__ import annotations

import logging

import pytest

from engine.core.thread_governor import ThreadGovernor


class Machine:
    """A clock, and a meter that reads, as ``engine/core/cpu.py``'s does, what other processes used on average since
    its last reading."""

    def __init__(self) -> None:
        self.now = 0.0
        self.others: float | None = 0.0  # the rate now, in CPUs; None: the meter cannot read
        self.used = 0.0  # CPU-seconds others used, in all
        self.read_at = (0.0, 0.0)  # (time, used) at the last reading
        self.team: list[int] = []

    def governor(self, max_threads: int = 2, cpus: int = 2) -> ThreadGovernor:
        return ThreadGovernor(max_threads, cpus, self.sample, self.team.append, clock=lambda: self.now)

    def sample(self) -> float | None:
        (then, used), self.read_at = self.read_at, (self.now, self.used)
        if self.others is None or self.now <= then:
            return None
        return (self.used - used) / (self.now - then)

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.used += seconds * (self.others or 0.0)

    def steps(self, governor: ThreadGovernor, seconds: float, others: float | None) -> None:
        """Step for ``seconds`` (a step every 50 ms) while others use ``others`` CPUs."""
        self.others = others
        for _ in range(round(seconds / 0.05)):
            governor.before_step()
            self.advance(0.05)
            governor.after_step()

    def idles(self, seconds: float, others: float) -> None:
        """No steps for ``seconds`` while others use ``others`` CPUs."""
        self.others = others
        self.advance(seconds)


def test_a_busy_neighbour_takes_a_thread_and_gives_it_back(caplog: pytest.LogCaptureFixture) -> None:
    machine = Machine()
    governor = machine.governor()
    machine.steps(governor, 2.0, 0.0)
    assert governor.threads == 2 and machine.team == []
    with caplog.at_level(logging.INFO, "engine.core.thread_governor"):
        machine.steps(governor, 2.0, 0.8)  # one busy loop, sharing the cores with the team
    assert governor.threads == 1 and machine.team == [1]
    assert "2 -> 1 threads: other processes used 0.80 of this process's 2 CPUs" in caplog.text
    machine.steps(governor, 2.0, 1.0)  # the neighbour now has a core of its own: the team stays at one
    assert machine.team == [1]
    machine.steps(governor, 2.0, 0.1)  # it left (a load generator's 0.1 of a core remains)
    assert governor.threads == 2 and machine.team == [1, 2]


def test_one_window_of_a_burst_changes_nothing() -> None:
    machine = Machine()
    governor = machine.governor()
    machine.steps(governor, 0.55, 1.0)
    machine.steps(governor, 2.0, 0.0)
    assert machine.team == [] and governor.threads == 2


def test_the_team_never_drops_below_one_nor_grows_past_its_size() -> None:
    machine = Machine()
    governor = machine.governor(max_threads=4, cpus=8)
    machine.steps(governor, 2.0, 7.9)
    assert governor.threads == 1
    machine.steps(governor, 2.0, 0.0)
    assert governor.threads == 4  # --threads / the quota, though 8 CPUs are idle
    assert [governor.target(others) for others in (0.0, 3.9, 4.5, 6.5, 7.5)] == [4, 4, 4, 2, 1]


def test_small_use_by_others_keeps_the_whole_team() -> None:
    governor = Machine().governor()
    assert [governor.target(others) for others in (0.0, 0.3, 0.59, 0.61, 1.0, 1.4, 2.0)] == [2, 2, 2, 1, 1, 1, 1]


def test_an_unreadable_meter_leaves_the_team_alone() -> None:
    machine = Machine()
    governor = machine.governor()
    machine.steps(governor, 3.0, None)
    assert machine.team == [] and governor.threads == 2


def test_what_others_use_while_the_engine_is_idle_is_no_contention() -> None:
    """Before: a window spanned idle gaps, so in an A/B benchmark the other server's runs, made while this one
    sat idle, counted as a neighbour's, and the team shrank for nothing (1 stream at 0.63x)."""
    machine = Machine()
    governor = machine.governor()
    for _ in range(4):
        machine.idles(2.0, 1.8)  # the other server runs
        machine.steps(governor, 0.3, 0.1)  # then this one, beside its client (64 tokens at 1 stream)
    assert machine.team == [] and governor.threads == 2
    machine.idles(2.0, 1.8)
    machine.steps(governor, 2.0, 0.9)  # a neighbour while it steps still counts
    assert machine.team == [1]
