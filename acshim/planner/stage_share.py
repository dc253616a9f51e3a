"""A pipeline rank's budget, split between its schedule and the microbatches alive at once.

A pipeline stage is planned for one microbatch (``pipelines``): the rank's budget first pays for
what the schedule holds outside the stage module (``ScheduleHeld``), less ``HEADROOM`` of the whole
(room for what counting the schedule's tensors misses: allocator slack, code paged in), and the
rest is shared by the ``in_flight`` microbatches the schedule keeps alive. ``StageShare`` does that
arithmetic both ways (the rank's budget from one microbatch's, one microbatch's from the rank's)
and says the rank's predicted and measured peak at the end of a run.
"""

from __future__ import annotations

from dataclasses import dataclass

from .budget import format_bytes
from .pipelines import PipelineStage, ScheduleHeld
from .plan import HEADROOM, Plan


@dataclass
class StageShare:
    """This rank's ``stage``, what its schedule ``held`` and the rank's whole budget in bytes."""

    stage: PipelineStage
    held: ScheduleHeld
    rank_budget: int = 0
    """The rank's whole budget in bytes, once known (``microbatch`` sets it; a plan file keeps it)."""

    def microbatch(self, whole: int) -> int:
        """One microbatch's bytes on a rank that may use ``whole``: what is left once the schedule's
        part is paid, less ``HEADROOM`` of the whole, shared by the microbatches alive."""
        self.rank_budget = whole
        rest = int(whole * (1 - HEADROOM)) - self.held.total
        return max(1, rest // self.stage.in_flight)

    def of_fraction(self, limit: int, fraction: float) -> int:
        """A fractional budget: ``limit`` is that share of one microbatch's step without
        checkpointing; the rank's budget is that share of the rank's whole step without it
        (``in_flight`` such microbatches and what the schedule holds), and one microbatch's share
        is what is left of it once the schedule's part is paid (``microbatch``)."""
        return self.microbatch(self.stage.in_flight * limit + int(fraction * self.held.total))

    def budget(self, plan: Plan) -> int:
        """The bytes this rank may use above its first step's start."""
        return self.rank_budget or plan.budget * self.stage.in_flight

    def predicted(self, plan: Plan) -> int:
        """The rank's predicted peak above its first step's start: what the schedule holds, what the
        process held besides when the plan was solved (gradients, ...), and ``in_flight``
        microbatches each at its predicted activations' peak (an upper bound: only one is at its
        peak at a time)."""
        return self.held.total + plan.overhead + self.stage.in_flight * plan.peak

    def planned(self, plan: Plan, rank: int, what: str) -> str:
        """The log line of a plan made for this stage: ``what`` it replaced and predicts
        (``PlanSession.summary``)."""
        return (f"acshim: --budget {format_bytes(self.budget(plan))} on rank {rank}, {self.stage.describe()}: "
                f"the schedule holds {format_bytes(self.held.total)} ({self.held.describe()}): planned for one "
                f"microbatch within {format_bytes(plan.budget)} ((the budget less {HEADROOM:.0%} - "
                f"{format_bytes(self.held.total)}) / {self.stage.in_flight}): {what}")

    def ended(self, plan: Plan, rank: int, measured: int) -> str:
        """The rank's line at the end of the run: its budget, predicted and ``measured`` peak."""
        return (f"acshim: --budget {format_bytes(self.budget(plan))} on rank {rank}, pipeline stage "
                f"{self.stage.stage} of {self.stage.stages}: predicted peak {format_bytes(self.predicted(plan))} "
                f"({format_bytes(self.held.total)} schedule + {self.stage.in_flight} x {format_bytes(plan.peak)} "
                f"activations + {format_bytes(plan.overhead)} held besides), measured "
                f"{format_bytes(measured)} (VmHWM above the first step's start)")
