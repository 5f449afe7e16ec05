"""The thread team follows the CPUs other processes leave free: it shrinks when a neighbour keeps cores busy,
grows back when it leaves, and does not flap on a one-window burst."""

from __future__ import annotations

import logging

import pytest

from engine.thread_governor import ThreadGovernor


class Machine:
    """A clock and what other processes use, as the governor reads them."""

    def __init__(self) -> None:
        self.now = 0.0
        self.others: float | None = 0.0
        self.team: list[int] = []

    def governor(self, max_threads: int = 2, cpus: int = 2) -> ThreadGovernor:
        return ThreadGovernor(max_threads, cpus, lambda: self.others, self.team.append, clock=lambda: self.now)

    def steps(self, governor: ThreadGovernor, seconds: float, others: float | None) -> None:
        """Step for ``seconds`` (a step every 50 ms) while others use ``others`` CPUs."""
        self.others = others
        for _ in range(round(seconds / 0.05)):
            self.now += 0.05
            governor.after_step()


def test_a_busy_neighbour_takes_a_thread_and_gives_it_back(caplog: pytest.LogCaptureFixture) -> None:
    machine = Machine()
    governor = machine.governor()
    machine.steps(governor, 2.0, 0.0)
    assert governor.threads == 2 and machine.team == []
    with caplog.at_level(logging.INFO, "engine.thread_governor"):
        machine.steps(governor, 1.2, 0.8)  # one busy loop, sharing the cores with the team
    assert governor.threads == 1 and machine.team == [1]
    assert "2 -> 1 threads: other processes used 0.80 of this process's 2 CPUs" in caplog.text
    machine.steps(governor, 2.0, 1.0)  # the neighbour now has a core of its own: the team stays at one
    assert machine.team == [1]
    machine.steps(governor, 1.2, 0.1)  # it left (a load generator's 0.1 of a core remains)
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
