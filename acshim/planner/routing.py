"""The router's seams: what ``PlanSession.route`` does with a region call (``Mode``), and what the
planner's other modules may use of the session (``PlanningContext``).

Only the session assigns its mode: a module that needs region calls routed another way for a while
(a fake step, a measurement) asks for it with ``PlanningContext.routing``, which puts the mode back
when its block ends or raises. ``PlanningContext`` lists what ``estimate``, ``feedback``,
``lockstep`` and ``profiler`` use of ``session.PlanSession``, so none of them imports it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from torch import nn

    from .choices import SharedOffload
    from .pipelines import PipelineStage
    from .plan import Plan
    from .profile import Profile
    from .sites import RegionSite


class Mode(StrEnum):
    """What ``PlanSession.route`` does with a checkpointed region call. A ``StrEnum``: each mode
    equals its former string (``session.mode == "planned"`` still holds)."""

    IDLE = "idle"
    """No plan yet: the call plans there and then (``PlanSession._plan_now``) and is then routed by
    the mode planning left (planned, deferred or explore). A call that still finds it idle
    recomputes (default options)."""
    DEFERRED = "deferred"
    """An SMP v1 pipeline stage's first microbatch (it plans on its second): the call runs holding
    least (recomputed, its input offloaded where the choices offer it). The next microbatch's first
    call sets the mode back to idle."""
    EXPLORE = "explore"
    """A sharded model planned on the script's own steps: the call runs as ``lockstep`` explores it
    (recomputed, or as the step's storage choice), measured."""
    PLAIN = "plain"
    """A forward on fake tensors (``estimate.step_peak``, a pipeline stage's output size): the call
    runs as a plain call, nothing checkpointed."""
    COUNT = "count"
    """Planning's counting forward (``RegionProfiler.count``): the call runs with its saved tensors
    counted and not kept, its input captured, its output detached."""
    REPLAY = "replay"
    """Planning's measurement of the part outside the regions (``RegionProfiler.outside``): the call
    returns an output of the shapes its region recorded instead of running; a call past the recorded
    regions recomputes."""
    ALONE = "alone"
    """Planning's measurement of one region alone (``RegionProfiler.regions``): the measured region
    runs its choice directly (``run_choice``), so a call routed here (one nested in it) recomputes."""
    MEASURE = "measure"
    """Planning's verification of a candidate plan (``RegionProfiler.verify``): the call runs as the
    candidate's choice at its position; a call past the candidate's end recomputes."""
    PLANNED = "planned"
    """The plan runs: the call runs as the plan's choice at its position, timed while ``feedback``
    watches; a call past the plan's end recomputes."""


@runtime_checkable
class PlanningContext(Protocol):
    """What the planner's modules use of the session that routes region calls
    (``session.PlanSession``): ``estimate.step_peak``, ``feedback.StepTimer``,
    ``lockstep.LockstepPlanner`` and ``profiler.RegionProfiler``."""

    budget: int | float | str
    choices: tuple[str, ...]
    storage: str | None
    prefetch: int
    retries: int
    api: bool
    world: int
    position: int
    """The position in the step of the next region call (a step restarts it at 0)."""
    sites: list[RegionSite]
    names: list[str]
    plan: Plan | None
    root: nn.Module | None
    pipeline: PipelineStage | None

    def routing(self, mode: Mode, candidate: list[str] | None = None,
                schedules: dict[str, SharedOffload] | None = None) -> contextlib.AbstractContextManager[None]:
        """Route region calls in ``mode`` (with ``candidate``'s choices, ``schedules`` the offload
        schedules its offloaded regions share) inside the ``with`` block; as before it after."""
        ...

    def run_outside(self, root: nn.Module, choice: str,
                    schedules: dict[str, SharedOffload] | None = None) -> None:
        """Run the part of ``root`` outside the regions as ``choice`` from now on."""
        ...

    def run_choice(self, site: RegionSite, choice: str, function: Callable[..., Any], args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> Any:
        """Run one region call as ``choice``."""
        ...

    def resolve(self, profile: Profile, why: str) -> bool:
        """Solve ``profile`` again at the same budget, verified; True if the plan changed."""
        ...

    def held_now(self) -> int | None:
        """The process's memory above the first planned step's start now, or None."""
        ...

    def offload_wait_seconds(self) -> float:
        """Seconds the plan's offloaded regions have waited for prefetches, so far."""
        ...

    @property
    def planned_budget(self) -> int | float | str:
        """The budget plans are solved within (a fraction's bytes once the first plan fixed them)."""
        ...
