"""What a refused budget says: the budget it names and why, tested before it is named.

``solve_within`` refuses with ``solver.BudgetTooSmall`` (no plan's prediction fits) or
``plan.NoPlanMeasured`` (every plan verified went over, the least plan too). Neither knows what the
run charges besides its measurements (``Charges``: the script's own loss, code paged in, optimizer
state to come) nor can it measure again; ``Refusal`` adds both to the error before it reaches the
user: the frontier's least budget with the charges and headroom, measured further where a part was
stopped on its way over (``measure_stopped``), then tested by planning at it
(``tested_suggestion``), so that the budget a refusal names plans.

Only one process planning alone, on a profile of its own, measures beyond the budget it refuses
(``Refusal.measures_beyond``): ranks planning together run their measurements in lock-step, and a
pipeline stage's budget is a share of its rank's, so they name the untested bound.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from .budget import format_bytes
from .plan import HEADROOM, NoPlanMeasured, Plan, least_budget, solve_within
from .process import guarded_budget
from .profile import INFEASIBLE, Profile
from .profiler import RegionProfiler, Verification
from .solver import BudgetTooSmall, minimum_peak

SUGGESTION_TRIES = 5
"""Budgets a refusal tests before it names one untested (``Refusal.tested_suggestion``), each 10% or
more above the last: in a freshly installed environment under load, three (up to 1.33x the first)
once ended untested on HF Llama 6x128 at 0.3 (12.6 MiB of code paged in charged, against 9.5 here)."""


@dataclass(frozen=True)
class Charges:
    """What a plan is charged besides its verification's measurement, which cannot see it: the
    script's own loss and its backward beyond the planning loss's, the code the step paged in
    (file-backed pages; the verification reads anonymous memory) and the optimizer state a first
    ``step()`` will make, and what ``acshim.plan`` loaded into the process the first time it ran
    (``loaded``: the code and state ``warmup`` loads, resident from then on, above what the process
    held when the call was made). Charged once, explicitly, with the verification's headroom."""

    script_part: int = 0
    paged: int = 0
    foreseen: int = 0
    loaded: int = 0

    @property
    def total(self) -> int:
        return self.script_part + self.paged + self.foreseen + self.loaded

    def reserve(self) -> int:
        """The bytes a budget keeps for them: the plan is solved and verified within the rest."""
        return math.ceil(self.total / (1 - HEADROOM))

    def __str__(self) -> str:
        parts = []
        if self.script_part:
            parts.append(f"{format_bytes(self.script_part)} for the script's own loss and its backward beyond the "
                         "planner's loss (measured on the planning step; until then, twice the model's output)")
        if self.paged:
            parts.append(f"{format_bytes(self.paged)} of code the step paged in (file-backed pages, resident from "
                         "then on)")
        if self.foreseen:
            parts.append(f"{format_bytes(self.foreseen)} of optimizer state its first step() will make")
        if self.loaded:
            parts.append(f"{format_bytes(self.loaded)} that planning loaded into the process once (torch._dynamo, "
                         "acshim's extensions; resident from then on)")
        return " and ".join(parts)

    def charge(self, plan: Plan) -> None:
        """Add them to ``plan``'s whole-step prediction and to its measured peak (the verified step
        had none of them: the whole step as the script's later steps hold it, so that the predicted
        and measured figures printed compare like with like)."""
        plan.overhead += self.total
        if plan.measured_process_peak is not None:
            plan.measured_process_peak += self.total
        if self.total:
            plan.notes.append(f"charged: {self}")


def why_least(profile: Profile, overhead: int, least: int) -> str:
    """Why ``least`` (``plan.least_budget``) plans: what it is made of."""
    return (f"the least peak the planner predicts, {format_bytes(minimum_peak(profile))}, plus "
            f"{format_bytes(overhead)} the process held besides, with the verification's {HEADROOM:.0%} headroom "
            f"and every measurement that plan needs within the guard, and {BudgetTooSmall.MARGIN:.0%} more: "
            f"{format_bytes(least)}")


@dataclass
class Refusal:
    """A plan solved within ``limit`` less ``charges``' reserve on ``profile`` (measured by
    ``profiler``): what its refusal names. ``least`` and ``overhead``: the frontier's least budget
    and what the process held besides when it was solved; ``measure`` verifies a plan on one step;
    ``measures_beyond``: whether this process may go over the budget it refuses to name one that
    plans (one process alone, on a profile of its own); ``verify``: whether plans are verified."""

    profile: Profile
    profiler: RegionProfiler
    limit: int | None
    charges: Charges
    least: int
    overhead: int
    measure: Callable[[Plan], Verification]
    retries: int
    measures_beyond: bool
    verify: bool

    @property
    def reserve(self) -> int:
        return self.charges.reserve() if isinstance(self.limit, int) else 0

    def too_small(self, error: BudgetTooSmall, counted_over: bool) -> None:
        """No plan's prediction fits (or the counting forward went over, ``counted_over``): the error
        names the frontier's least budget (measuring what was stopped where it may), the charges,
        and the result of planning at it."""
        limit, reserve, least = self.limit, self.reserve, self.least
        if (not least or counted_over) and error.suggested and isinstance(limit, int) and self.measures_beyond:
            least = self.measure_stopped(error.suggested + reserve)
        if reserve:
            error.args = (f"{format_bytes(limit or 0)} less {format_bytes(reserve)} charged besides the "
                          f"measurement (below) leaves {error}",)
        if least and isinstance(limit, int):  # the frontier's own start (plan.least_budget), not a guess
            error.suggested = max(least + reserve, limit + 1)
            error.why = why_least(self.profile, self.overhead, least)
            if reserve:
                error.why += f"; and {self.charges}, with the headroom: {format_bytes(least + reserve)}"
            error.suggested, error.why = self.tested_suggestion(error.suggested, error.why)
        elif error.suggested:
            error.suggested += reserve
            if reserve:
                error.why = f"{self.charges} charged besides: {format_bytes(reserve)} with the headroom"

    def none_measured(self, error: NoPlanMeasured) -> None:
        """Every plan verified went over, the least plan too: its measurement names the budget, with
        the charges, tested by planning at it."""
        if not (error.suggested and isinstance(self.limit, int)):
            return
        reserve, least = self.reserve, self.least
        error.suggested = max(error.suggested + reserve, least + reserve if least else 0, self.limit + 1)
        if reserve:
            error.why += f"; and {self.charges}, with the headroom"
        error.suggested, error.why = self.tested_suggestion(error.suggested, error.why)

    def measure_stopped(self, bound: int) -> int:
        """Where some part could not be measured within the budget: measure what went over within
        ``bound`` (the budget that stop suggests, ``solver.suggest_unmeasured``) and return the
        frontier's least budget then (0 if a part is still unmeasurable); ``overhead`` becomes what
        the process holds besides once the regions' captured inputs are freed. The process goes
        over the budget it refuses while doing so; it then ends (``acshim run``) or raises
        (``acshim.plan``)."""
        self.profiler.measure_stopped(self.profile, bound)
        self.profiler.drop_copies()
        self.overhead = self.profiler.used()
        self.least = least_budget(self.profile, self.overhead, self.profiler.needed_for, guarded_budget)
        return self.least

    def tested_suggestion(self, suggested: int, why: str) -> tuple[int, str]:
        """A suggested budget, tested before it is named: the profile solved and verified within it,
        less the reserve, as planning at that budget would (its re-solves, then the least plan).
        Where no plan measured within it, the suggestion grows to what the least plan measured, with
        the headroom and the margin (by 10% at least), and is tested again: ``SUGGESTION_TRIES``
        times at most, the last named untested if none passed. Only where plans are verified and
        this process ``measures_beyond`` the budget."""
        profile, profiler = self.profile, self.profiler
        if not (self.verify and self.measures_beyond and suggested) or minimum_peak(profile) >= INFEASIBLE:
            return suggested, why
        profiler.drop_copies()  # the regions' captured inputs are no part of the steps verified
        first, reserve = suggested, self.reserve
        for _ in range(SUGGESTION_TRIES):
            within = suggested - reserve
            profiler.set_limit(suggested)  # the guard leaves out the code paged in itself, as planning's
            try:
                found = solve_within(profile, within, self.measure, retries=self.retries, overhead=self.overhead)
            except NoPlanMeasured as error:
                seen = error.least_seen if error.least_seen is not None and error.least_seen < INFEASIBLE else 0
                grown = math.ceil(seen / (1 - HEADROOM) * (1 + BudgetTooSmall.MARGIN)) + reserve
            except BudgetTooSmall:  # what was held besides grew: the least peak with it is above the budget
                grown = 0
            else:
                measured = found.measured_process_peak if found.measured_process_peak is not None else found.measured_peak
                raised = ("" if suggested == first else
                          f"; no plan measured within {format_bytes(first)} (tested), nor within the larger budgets "
                          f"tried in turn up to this one")
                return suggested, (f"{why}{raised}; tested: planning at it measured {found.describe()} at "
                                   f"{format_bytes(measured or 0)} of {format_bytes(within)}")
            suggested = max(grown, math.ceil(suggested * (1 + 2 * BudgetTooSmall.MARGIN)))
        return suggested, (f"{why}; untested: no plan measured within the budgets below it, tried in turn "
                           "(each 10% or more above the last)")
