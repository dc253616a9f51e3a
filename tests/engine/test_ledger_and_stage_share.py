"""The planner's bookkeeping split out of the session (issue 26 item 3): what the plan in force was
charged for (``planner.ledger``) and a pipeline rank's budget shared between its schedule and its
microbatches (``planner.stage_share``). Pure arithmetic on small tensors; the sessions that use them
are tested end to end in tests/hf/test_plain_loop_budget.py, tests/engine/test_training_state.py and
the pipeline budget tests."""

from __future__ import annotations

import torch
from torch import nn

from acshim.planner.ledger import MAX_STATE_RESOLVES, ChargeLedger
from acshim.planner.pipelines import PipelineStage, ScheduleHeld
from acshim.planner.plan import HEADROOM, Plan
from acshim.planner.profile import BlockProfile, Profile
from acshim.planner.stage_share import StageShare
from acshim.planner.training_state import OptimizerWatch

MiB = 1 << 20


def _plan(budget: int, peak: int, overhead: int = 0) -> Plan:
    blocks = [BlockProfile("b0", {"keep": 1 * MiB}, {"keep": 1 * MiB}, {"keep": 0.01})]
    profile = Profile(blocks, ["keep"], other_held=0, other_transient=0, other_seconds=0.0, signature="x", prefetch=2)
    return Plan(budget, ["b0"], ["keep"], held=peak, peak=peak, seconds=0.01, profile=profile, overhead=overhead)


def _stage(in_flight: int) -> PipelineStage:
    return PipelineStage("torch.distributed.pipelining", "Schedule1F1B", nn.Linear(2, 2), (), {}, stage=0, stages=2,
                         microbatches=4, in_flight=in_flight)


def test_a_stage_shares_what_its_schedule_leaves_between_the_microbatches_alive_and_says_it_back() -> None:
    share = StageShare(_stage(in_flight=2), ScheduleHeld([("receive buffers", 6 * MiB), ("outputs kept", 4 * MiB)]))
    one = share.microbatch(100 * MiB)
    assert one == (int(100 * MiB * (1 - HEADROOM)) - 10 * MiB) // 2
    assert share.rank_budget == 100 * MiB
    plan = _plan(one, peak=30 * MiB, overhead=2 * MiB)
    assert share.budget(plan) == 100 * MiB                       # the rank's, not one microbatch's times two
    assert share.predicted(plan) == 10 * MiB + 2 * MiB + 2 * 30 * MiB
    line = share.ended(plan, rank=1, measured=70 * MiB)
    assert "rank 1" in line and "2 x 30.0 MiB activations" in line and "measured 70.0 MiB" in line, line


def test_a_fraction_on_a_stage_is_of_the_rank_whole_step_without_checkpointing() -> None:
    share = StageShare(_stage(in_flight=3), ScheduleHeld([("buffers", 8 * MiB)]))
    one = share.of_fraction(20 * MiB, 0.5)                    # 0.5 of one microbatch's step is 20 MiB
    whole = 3 * 20 * MiB + int(0.5 * 8 * MiB)
    assert share.rank_budget == whole
    assert one == (int(whole * (1 - HEADROOM)) - 8 * MiB) // 3
    assert StageShare(_stage(1), ScheduleHeld([])).budget(_plan(5 * MiB, MiB)) == 5 * MiB  # no rank budget yet


def test_the_script_part_is_charged_again_only_where_its_measurement_differs_by_more_than_the_resolution() -> None:
    ledger = ChargeLedger(script_part=4 * MiB)
    assert ledger.script_measured_as(4 * MiB + 1000, resolution=MiB) is None
    assert ledger.script_measured and ledger.script_part == 4 * MiB
    assert ledger.script_measured_as(9 * MiB, resolution=MiB) == 4 * MiB   # the charge it replaces
    assert ledger.script_part == 9 * MiB
    charges = ledger.charges(paged=3 * MiB)
    assert (charges.script_part, charges.paged, charges.foreseen, charges.loaded) == (9 * MiB, 3 * MiB, 0, 0)


def test_training_state_grown_past_the_plan_room_is_reported_at_most_twice_a_run() -> None:
    model = nn.Linear(512, 512)          # 1 MiB of weights
    optimizer = torch.optim.AdamW(model.parameters())
    ledger = ChargeLedger(watch=OptimizerWatch().start())
    try:
        ledger.solved(model, paged=0)    # solved holding nothing
        plan = _plan(budget=9 * MiB, peak=7 * MiB)
        assert ledger.grown(model, plan, paged_now=0) is None
        model(torch.randn(4, 512)).sum().backward()
        optimizer.step()                 # now 1 MiB of gradients and 2 MiB of AdamW state, seen stepping
    finally:
        ledger.watch.stop()
    growth = ledger.grown(model, plan, paged_now=MiB)
    assert growth is not None
    assert growth.now.gradients >= MiB and growth.now.optimizer >= 2 * MiB, growth
    assert growth.grown == growth.now.total + MiB and growth.paged == MiB
    assert "1.0 MiB more code paged in" in growth.why() and "predicted with them" in growth.why()
    roomy = _plan(budget=100 * MiB, peak=7 * MiB)  # the same growth within the room a plan left
    assert ChargeLedger(watch=ledger.watch, state=ledger.state).grown(model, roomy, paged_now=MiB) is None
    for _ in range(MAX_STATE_RESOLVES - 1):
        assert ledger.grown(model, plan, paged_now=MiB) is not None
    assert ledger.grown(model, plan, paged_now=MiB) is None   # at most MAX_STATE_RESOLVES a run
