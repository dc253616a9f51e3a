"""Step-time estimates that machine noise does not flip: compute from operator durations, transfers
from what they really cost.

A choice's time is measured once, on its tracked run (``LiveBytes(timed=True)``): its wall time less
the tracker's own time is what it takes untracked. It is then re-estimated operator by operator:
each operator (``tracker.op_key``: operator, shapes, small arguments) counts at the least duration
it took anywhere in the profile (keep's forward and recompute's replay of it, every choice of every
block alike), and the time between operators (Python, autograd, dispatch) at the least per-operator
rate any computing run showed. So a burst of other work on the cores while one choice ran does not
make that choice look slow, and recompute costs exactly its extra forward more than keep. (A
selective policy's own Python per operator is a fraction of a percent of a block's time on models
worth planning; it is left in that rate.) Choices that move data keep, beyond that rate, what their
run really spent between operators: waits for a storage tier's copies. They (offload) are charged, on top, the processor time their
copies took on other threads (``time.process_time`` less the calling thread's): on an idle machine
those threads run beside compute on a spare core, on a busy one they take its place, and the
estimate is the busy machine's, so that an offloading plan is chosen only where it wins either way
and the same inputs give the same plan whatever else shares the cores.

Two costs of moving data show in a step and not in those figures, so a block measured alone is also
charged them (``estimate(..., alone=True)``): the waits of its backward for reads its prefetch had
not landed (``waits``: the offload session's own count, which excludes the wait for the forward's
last copies that a block alone meets and a block in a step does not), and the slowdown of its own
operators while its copies ran beside them (``slowdown``: its operators' time over their least,
against the same figure of the block kept; the copies take memory bandwidth and cache from the
compute, which the least durations, taken from runs with no copies, do not show). On HF GPT-2 8x384
(batch 2x256) an offloaded block ran 1.17x its prediction in the plan's steps, with 67-96 ms a step
of prefetch waits, where recompute ran as predicted: the plan with 6 blocks on disk stepped in
1.18-1.41 s and, re-solved in another process, the one recomputing them in 1.03-1.07 s (pinned with
``--plan-file``, two rounds of 7 steps: medians 1.27 and 1.26 s against 1.07 and 1.20 s), and
without these charges the planner took the first in most processes and the second in the rest
(alone, that block's operators ran 1.11-1.23x keep's ratio to their least, and its backward waited
7-8 ms). Under load the slowdown is noise (0.91-1.09x with two cores kept busy), and plans there can
still differ from an idle machine's. On another machine (or the same one's virtual disk hours
later) a step of offloaded blocks ran far below these charges; ``probe.py`` compares a verified plan
with the plan that free copies would give on one measured step (not yet enabled: see there).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any


class OpTimes:
    """The least duration seen per operator key, over every timed run of a profile, and the least
    time between operators per operator (``per_op``) over the computing runs (``observe_run``)."""

    def __init__(self) -> None:
        self.best: dict[Any, float] = {}
        self.per_op = float("inf")

    def observe_run(self, run: RunTime, moves_data: bool = False) -> None:
        self.observe(run.durations)
        if not moves_data and run.durations:
            self.per_op = min(self.per_op, run.between_ops / len(run.durations))

    def observe(self, durations: Iterable[tuple[Any, float]]) -> None:
        best = self.best
        for key, seconds in durations:
            known = best.get(key)
            if known is None or seconds < known:
                best[key] = seconds

    def compute_seconds(self, durations: Iterable[tuple[Any, float]]) -> float:
        """The operators' time at their least observed durations."""
        best = self.best
        return sum(best.get(key, seconds) for key, seconds in durations)


class RunTime:
    """One timed run: its untracked wall time, its operators' durations and the processor time other
    threads spent meanwhile (``other_cpu``)."""

    def __init__(self, wall: float, own: float, durations: list[tuple[Any, float]], other_cpu: float = 0.0,
                 waits: float = 0.0) -> None:
        self.seconds = max(0.0, wall - own)
        self.durations = durations
        self.in_ops = sum(seconds for _, seconds in durations)
        self.other_cpu = max(0.0, other_cpu)
        self.waits = max(0.0, waits)
        """Backward's waits for reads not yet landed (an offload session's ``stats.wait_seconds``)."""

    def slowdown(self, times: OpTimes) -> float:
        """This run's operators' time over the same operators at their least observed durations."""
        least = times.compute_seconds(self.durations)
        return self.in_ops / least if least > 0 else 1.0

    @property
    def between_ops(self) -> float:
        return max(0.0, self.seconds - self.in_ops)

    def estimate(self, times: OpTimes, moves_data: bool = False, alone: bool = False, kept: RunTime | None = None
                 ) -> float:
        """Seconds untracked, operators and the time between them at their least observed rates;
        ``moves_data`` (offload): plus the other threads' processor time and its own time between
        operators beyond that rate (waits for copies; see the module docstring), except for a part
        run ``alone`` (a block alone, the outside part with the regions replayed): there its backward
        waits for the very copies its forward started, which in a step overlap the other blocks'
        forwards and backwards (prefetch), and how long it waits follows the machine's load. On HF
        GPT-2 8x512 those waits made a block's disk offload 1.41x of keeping it where the whole step
        offloaded measured 1.12x idle, 1.17x with a core kept busy; a plan's step as it really runs
        is measured when it is verified, and re-solved if slower than predicted (feedback.py). A part
        run alone is charged instead its backward's prefetch ``waits`` and, against the run of the
        same part ``kept`` (no copies), its operators' extra ``slowdown`` (module docstring)."""
        rate = times.per_op if times.per_op < float("inf") else self.between_ops / max(1, len(self.durations))
        between = rate * len(self.durations)
        compute = times.compute_seconds(self.durations)
        seconds = compute + between
        if moves_data:
            seconds += self.other_cpu + (self.waits if alone else max(0.0, self.between_ops - between))
            if alone and kept is not None:
                seconds += compute * max(0.0, self.slowdown(times) / kept.slowdown(times) - 1.0)
        return seconds


class Stopwatch:
    """Wall time and other threads' processor time of a block of code: ``with Stopwatch() as watch``."""

    def __enter__(self) -> Stopwatch:
        self.start, self.cpu, self.own = time.perf_counter(), time.process_time(), time.thread_time()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.wall = time.perf_counter() - self.start
        self.other_cpu = (time.process_time() - self.cpu) - (time.thread_time() - self.own)
