"""How many threads the engine's team runs, step by step, beside whatever else the machine is running. Torch-free.

A team that waits at a barrier in every parallel region runs at the pace of its slowest member: when another
process takes one of two cores, the thread the OS parks stalls the whole step, and throughput fell to a tenth
(measured: bench/README.md, "Busy neighbours"). So the governor watches how much of the process's CPUs other
processes use (``engine/core/cpu.py``'s ``NeighbourMeter``) and runs the team on what is left: on 2 CPUs, one busy
neighbour leaves 1 thread; when it goes, the team grows back. Each window (``window_s`` of stepping) gives a
target; the team changes when two windows in a row agree, so a short burst elsewhere does not flap it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

#: A gap this long between two steps means the engine sat idle: what ran meanwhile did not compete with it (in an
#: A/B benchmark, the other server's whole run), so the window starts again with the next step.
IDLE_GAP_S = 0.1
#: Fraction of a CPU others may use before the team gives it up: a team member that loses more than this to
#: others' time slices stalls its team more than its work is worth (a load generator beside the server, ~0.3 of
#: a core at 64 streams, does not; one busy loop, which takes 0.7-1.0, does).
YIELD_ABOVE = 0.6


class ThreadGovernor:
    def __init__(
        self,
        max_threads: int,
        cpus: int,
        sample: Callable[[], float | None],
        set_threads: Callable[[int], None],
        window_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``max_threads``: the team's size (``--threads``); ``cpus``: the CPUs the process may run on;
        ``sample``: other processes' busy CPUs since the last call; ``set_threads``: resizes the team (called on
        the thread that runs the steps)."""
        self.max_threads = max_threads
        self.threads = max_threads
        self._cpus = cpus
        self._sample = sample
        self._set_threads = set_threads
        self._window_s = window_s
        self._clock = clock
        self._window_start = clock()
        self._last_step_end = self._window_start
        self._pending: int | None = None
        #: Why the team last changed size, for the log and the server's description of itself.
        self.reason = f"{max_threads} threads: the process's CPUs"

    def target(self, others: float) -> int:
        """The team size for ``others`` CPUs busy with other processes: what they leave of ours, rounded down
        unless less than ``YIELD_ABOVE`` of a CPU is taken."""
        available = self._cpus - others + YIELD_ABOVE
        return max(1, min(self.max_threads, math.floor(available)))

    def before_step(self) -> None:
        """Called before each step: after an idle gap, the window starts again (only stepping time counts)."""
        now = self._clock()
        if now - self._last_step_end > IDLE_GAP_S:
            self._sample()  # a new baseline: what others used while the engine was idle is not contention
            self._window_start = now

    def after_step(self) -> None:
        """Called after each step: at the end of a window, measure and maybe resize the team."""
        now = self._last_step_end = self._clock()
        if now - self._window_start < self._window_s:
            return
        elapsed, self._window_start = now - self._window_start, now
        others = self._sample()
        if others is None:
            return
        wanted = self.target(others)
        if wanted == self.threads:
            self._pending = None
            return
        if self._pending != wanted:  # the first window that asks: wait for a second one to agree
            self._pending = wanted
            return
        self._pending = None
        self.reason = (
            f"{self.threads} -> {wanted} threads: other processes used {others:.2f} of this process's "
            f"{self._cpus} CPUs over the last {elapsed:.1f} s"
        )
        log.info("thread team: %s", self.reason)
        self.threads = wanted
        self._set_threads(wanted)
