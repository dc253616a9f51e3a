"""``acshim.planner.refusal``: what a refused budget is charged and names, apart from measuring
(the measured paths: tests/engine/test_planner_refusal_plans.py, tests/cli/test_budget_frontier.py)."""

from __future__ import annotations

import math

from acshim.planner.plan import HEADROOM, NoPlanMeasured, Plan
from acshim.planner.refusal import Charges, Refusal
from acshim.planner.solver import BudgetTooSmall

MiB = 2**20


def _plan() -> Plan:
    return Plan(budget=100 * MiB, blocks=["h.0"], choices=["recompute"], held=0, peak=40 * MiB, seconds=1.0,
                profile=None, measured_process_peak=42 * MiB, overhead=5 * MiB)  # type: ignore[arg-type]


def test_charges_are_reserved_with_the_headroom_and_added_to_the_whole_step_once() -> None:
    nothing = Charges()
    plan = _plan()
    nothing.charge(plan)
    assert (nothing.reserve(), str(nothing), plan.overhead, plan.notes) == (0, "", 5 * MiB, [])

    charges = Charges(script_part=2 * MiB, paged=3 * MiB, foreseen=1 * MiB, loaded=4 * MiB)
    assert charges.total == 10 * MiB
    assert charges.reserve() == math.ceil(10 * MiB / (1 - HEADROOM)) > 10 * MiB
    charges.charge(plan)
    assert (plan.overhead, plan.measured_process_peak) == (15 * MiB, 52 * MiB)
    assert plan.notes == [f"charged: {charges}"]
    assert str(charges) == (
        "2.0 MiB for the script's own loss and its backward beyond the planner's loss (measured on the planning "
        "step; until then, twice the model's output) and 3.0 MiB of code the step paged in (file-backed pages, "
        "resident from then on) and 1.0 MiB of optimizer state its first step() will make and 4.0 MiB that "
        "planning loaded into the process once (torch._dynamo, acshim's extensions; resident from then on)")


def _refusal(least: int, measures_beyond: bool = False) -> Refusal:
    return Refusal(profile=None, profiler=None, limit=100 * MiB, charges=Charges(paged=10 * MiB),  # type: ignore[arg-type]
                   least=least, overhead=0, measure=lambda plan: None, retries=6,  # type: ignore[arg-type,return-value]
                   measures_beyond=measures_beyond, verify=False)


def test_a_measured_refusal_names_its_measurement_with_the_charges_and_never_the_budget_refused() -> None:
    reserve = Charges(paged=10 * MiB).reserve()
    error = NoPlanMeasured("no plan measured within the budget", least_seen=120 * MiB)
    suggested = error.suggested
    _refusal(least=0).none_measured(error)
    assert error.suggested == suggested + reserve > 100 * MiB
    assert error.why.endswith("; and 10.0 MiB of code the step paged in (file-backed pages, resident from then on), "
                              "with the headroom")
    low = NoPlanMeasured("no plan measured within the budget", least_seen=10 * MiB)
    low.why = ""
    _refusal(least=0).none_measured(low)
    assert low.suggested == 100 * MiB + 1  # never the budget it refuses


def test_a_refusal_with_no_frontier_adds_the_charges_to_the_least_peak_it_names() -> None:
    reserve = Charges(paged=10 * MiB).reserve()
    error = BudgetTooSmall(100 * MiB - reserve, 140 * MiB)
    suggested = error.suggested
    _refusal(least=0).too_small(error, counted_over=False)
    assert error.suggested == suggested + reserve
    assert str(error).startswith(f"100.0 MiB less {reserve / MiB:.1f} MiB charged besides the measurement (below) "
                                 "leaves budget")
    assert error.why == f"10.0 MiB of code the step paged in (file-backed pages, resident from then on) charged " \
                        f"besides: {reserve / MiB:.1f} MiB with the headroom"
