"""Issue 26 item 5: a verified plan is compared, on one measured step, with the plan that offloading
would give if its copies were free (``planner.probe``), and the faster taken: offloading's price from
blocks measured alone (the busy machine's) is right on some machines and far above a step's on
others, and a plan that never offloads never measures it. Solver-level, on profiles shaped as HF
GPT-2 8x384 measured here, with the verification step a function of the plan (no timing noise)."""

from __future__ import annotations

import pytest

from acshim.planner.plan import HEADROOM, solve_within
from acshim.planner.probe import PROBE_MARGIN, computing_counterpart, copies_free
from acshim.planner.profile import INFEASIBLE, BlockProfile, Profile
from acshim.planner.profiler import Verification
from acshim.planner.solver import solve

MIB = 1 << 20
KEEP, SELECTIVE, RECOMPUTE = 0.2077, 0.2546, 0.2956


def gpt2_like(offload: float) -> Profile:
    """Eight identical blocks (ms per block: keep 207.7, selective 254.6, recompute 295.6, offload:disk
    ``offload``; recompute+offload:disk not measured within the budget) and the part outside them."""
    held = {"keep": 31.5, "selective": 11.25, "recompute": 0.75, "offload:disk": 0, "recompute+offload:disk": 0}
    transient = {"keep": 9, "selective": 29.25, "recompute": 39.75, "offload:disk": 28.75, "recompute+offload:disk": 40}
    seconds = {"keep": KEEP, "selective": SELECTIVE, "recompute": RECOMPUTE, "offload:disk": offload,
               "recompute+offload:disk": RECOMPUTE + offload - KEEP}
    window = {c: int(3.75 * MIB) if "offload" in c else 0 for c in held}
    blocks = []
    for i in range(8):
        block_held = {c: int(v * MIB) for c, v in held.items()}
        block_held["recompute+offload:disk"] = INFEASIBLE
        blocks.append(BlockProfile(f"h.{i}", block_held, {c: int(v * MIB) for c, v in transient.items()},
                                   dict(seconds), None if i == 0 else "h.0", window, saved=int(31.5 * MIB)))
    return Profile(blocks, list(held), int(3.26 * MIB), 2 * MIB, 0.0495, "x", 2,
                   outside={"offload:disk": {"held": 1 << 20, "transient": 5 << 19, "seconds": 0.0376}})


BUDGET = 130 << 20  # one block kept beside selective ones, or three beside offloaded ones


class Steps:
    """The verification step as a function of the plan: each block's true seconds (offloaded blocks at
    ``offload_true``), every plan ``peak`` bytes; records the plans measured."""

    def __init__(self, offload_true: float, peak: int = 100 << 20) -> None:
        self.offload_true, self.peak, self.measured = offload_true, peak, []

    def true_seconds(self, plan) -> float:
        truth = {"offload:disk": self.offload_true}
        return 0.0495 + sum(truth.get(c, plan.profile.blocks[i].seconds[c]) for i, c in enumerate(plan.choices))

    def __call__(self, plan) -> Verification:
        self.measured.append((list(plan.choices), plan.outside))
        return Verification(self.peak, self.peak, self.peak, self.true_seconds(plan))


def test_counterparts_and_free_copies_price_each_offload_choice_as_its_computing_one() -> None:
    assert [computing_counterpart(c) for c in ("offload:disk", "recompute+offload:disk", "offload:disk+head",
                                               "keep", "recompute", "head")] == \
        ["keep", "recompute", "head", None, None, None]
    free = copies_free(gpt2_like(0.40))
    for block in free.blocks:
        assert block.seconds["offload:disk"] == KEEP
        assert block.seconds["recompute"] == RECOMPUTE
        assert block.seconds["recompute+offload:disk"] == RECOMPUTE + 0.40 - KEEP  # not measured: left alone
    assert free.other("offload:disk")[2] == free.other("keep")[2] == 0.0495


def test_a_plan_priced_away_from_offload_takes_it_where_its_step_measures_faster() -> None:
    """Offload priced 1.9x keep (as blocks alone were here) but a step of it costs 1.05x: the plan
    solved first takes selective, the probe's step is faster beyond the margin, so the offloading plan is
    taken, verified, with its profile pricing offload as measured (solved again, it is the choice)."""
    profile = gpt2_like(0.40)
    steps = Steps(offload_true=KEEP * 1.05)
    first = solve_within(profile, BUDGET, steps)  # no probe: the plan as priced
    assert not any("offload" in c for c in first.choices), first.choices
    steps.measured.clear()
    plan = solve_within(profile, BUDGET, steps, probe=True)
    assert len(steps.measured) == 2 and steps.measured[0][0] == first.choices
    assert plan.choices == ["offload:disk"] * 5 + ["keep"] * 3, plan.choices  # three kept beside the copies
    assert plan.verified_seconds == pytest.approx(steps.true_seconds(plan))
    assert any("was taken" in note for note in plan.notes), plan.notes
    priced = plan.profile.blocks[0].seconds["offload:disk"]
    assert KEEP < priced < 0.40  # the measured copies' cost, not the alone price nor free
    assert plan.seconds == pytest.approx(plan.profile.seconds_of(plan.choices, plan.outside))
    target = int(BUDGET * (1 - HEADROOM))
    assert solve(plan.profile, target).choices == plan.choices  # a later solve on it agrees


def test_a_probe_measured_slower_keeps_the_plan_solved_first() -> None:
    """Where offloading's steps really cost what blocks alone said (1.9x keep), the probe measures it
    slower and the plan solved first stands, its notes saying what was tried."""
    profile = gpt2_like(0.40)
    steps = Steps(offload_true=0.40)
    plan = solve_within(profile, BUDGET, steps, probe=True)
    assert len(steps.measured) == 2
    assert not any("offload" in c for c in plan.choices), plan.choices
    assert plan.verified_seconds == pytest.approx(steps.true_seconds(plan))
    assert any("kept this one" in note for note in plan.notes), plan.notes


def test_a_probe_within_the_margin_is_not_taken() -> None:
    """A probe's step faster by less than the margin (verification steps carry a bias of a few
    percent) is not taken."""
    profile = gpt2_like(0.40)
    baseline = solve_within(profile, BUDGET, Steps(0.40))
    # the probe's plan (5 offloaded, 3 kept) measured half the margin faster than the baseline
    per_block = ((1 - PROBE_MARGIN / 2) * baseline.verified_seconds - 0.0495 - 3 * KEEP) / 5
    steps = Steps(offload_true=per_block)
    plan = solve_within(profile, BUDGET, steps, probe=True)
    assert steps.measured[1][0] == ["offload:disk"] * 5 + ["keep"] * 3
    assert len(steps.measured) == 2 and plan.choices == baseline.choices
    assert any("kept this one" in note for note in plan.notes), plan.notes


def test_no_step_is_spent_where_free_copies_would_not_gain_the_margin() -> None:
    """Offload priced barely above selective (gain of free copies below the margin, as where the
    budget keeps most blocks) or not offered: one verification, no probe."""
    roomy = 250 << 20  # six blocks kept
    steps = Steps(offload_true=KEEP)
    solve_within(gpt2_like(0.40), roomy, steps, probe=True)
    assert len(steps.measured) == 1
    steps = Steps(offload_true=KEEP)
    solve_within(gpt2_like(0.40), BUDGET, steps)  # probe off (ranks that solve together)
    assert len(steps.measured) == 1


def test_a_probe_measured_over_the_budget_keeps_the_plan_solved_first() -> None:
    profile = gpt2_like(0.40)

    class OverWhenOffloading(Steps):
        def __call__(self, plan) -> Verification:
            found = super().__call__(plan)
            if "offload:disk" in plan.choices:
                found.process_peak = BUDGET
            return found

    steps = OverWhenOffloading(offload_true=KEEP)
    plan = solve_within(profile, BUDGET, steps, probe=True)
    assert len(steps.measured) == 2 and not any("offload" in c for c in plan.choices)
    assert any("over the budget when measured" in note for note in plan.notes), plan.notes


def test_a_probe_whose_copies_fail_keeps_the_plan_solved_first() -> None:
    """A storage tier that fails the probe's copies (a full disk) does not end planning: the plan
    solved first needs no copies, and its notes say why nothing else was taken."""
    from acshim.storage.errors import OffloadIOError

    class FailingCopies(Steps):
        def __call__(self, plan) -> Verification:
            if "offload:disk" in plan.choices:
                raise OffloadIOError("writing 31.5 MiB to disk failed: No space left on device")
            return super().__call__(plan)

    plan = solve_within(gpt2_like(0.40), BUDGET, FailingCopies(offload_true=KEEP), probe=True)
    assert not any("offload" in c for c in plan.choices)
    assert any("its copies failed" in note and "No space left" in note for note in plan.notes), plan.notes


def test_no_probe_after_a_plan_measured_over_the_budget() -> None:
    """Where the first plan solved measured over the budget (its predictions ran low), the plan found
    after re-solving stands unprobed: a plan solved at the first target would likely be over too."""

    class FirstOver(Steps):
        def __call__(self, plan) -> Verification:
            found = super().__call__(plan)
            if len(self.measured) == 1:
                found.process_peak = BUDGET
            return found

    steps = FirstOver(offload_true=KEEP)
    plan = solve_within(gpt2_like(0.40), BUDGET, steps, probe=True)
    assert len(steps.measured) == 2 and not any("offload" in c for c in plan.choices), steps.measured
    assert any("re-solved under" in note for note in plan.notes), plan.notes
