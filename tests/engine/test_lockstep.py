"""``acshim.planner.lockstep`` on one process, its collectives stood in for by a rank's own numbers
(tests/distributed runs it on 2 real gloo ranks, FSDP2 and ZeRO-3): a sharded model is planned on
the script's own steps, two explored recomputed (and one per storage choice: offload:disk,
recompute+offload:disk, and one running one block selective and one selective-alt) and one verified, every step's gradients bitwise equal to no checkpointing;
a verification over the budget is solved again with the error as room."""

from __future__ import annotations

import pytest
import torch

import acshim
from acshim import region, selective
from acshim.planner import lockstep
from acshim.planner import session as session_module
from acshim.planner.choices import BASE_CHOICES
from acshim.planner.plan import Plan
from acshim.planner.session import PlanSession
from acshim.testing import GPT, assert_bitwise_equal, seeded, train_step


def _model() -> GPT:
    return seeded(lambda: GPT(layers=4, width=128, heads=4, seq=256, vocab=128))


def _ids() -> torch.Tensor:
    return torch.randint(0, 128, (4, 256), generator=torch.Generator().manual_seed(3))


@pytest.fixture
def one_rank_as_sharded(monkeypatch):
    """The session takes the model for a sharded one across 2 ranks; agreeing and broadcasting
    leave this rank's numbers as they are."""
    monkeypatch.setattr(session_module, "world_size", lambda: 2)
    monkeypatch.setattr(session_module, "sharded_by", lambda root: "a stand-in")
    monkeypatch.setattr(session_module, "agree_bytes", lambda value, device: value)
    monkeypatch.setattr(lockstep, "agree_bytes", lambda value, device: value)
    monkeypatch.setattr(lockstep, "agree_profile", lambda profile, device: profile)
    monkeypatch.setattr(lockstep, "agree_every_rank", lambda flags, device: flags)
    monkeypatch.setattr(lockstep.dist, "broadcast_object_list", lambda objects, src=0: None)
    monkeypatch.setattr(lockstep.dist, "get_world_size", lambda group=None: 2)
    sessions: list[PlanSession] = []
    yield sessions
    for session in sessions:
        session.stop()
    assert region.ROUTERS == []


@pytest.mark.parametrize("choices", [("keep", "recompute"), BASE_CHOICES], ids=["keep-recompute", "with-storage"])
def test_sharded_model_is_planned_on_its_own_steps_bitwise(one_rank_as_sharded, capsys, choices) -> None:
    expected = train_step(_model(), _ids(), seed=5)
    model = _model()
    acshim.apply_checkpointing(model)
    session = PlanSession(0.8, choices=choices).start()
    one_rank_as_sharded.append(session)
    explored = lockstep.explore_steps(session)
    # the storage choices' steps (offload, recompute+offload), then one sampling selective and selective-alt
    assert explored == (2 if len(choices) == 2 else 5)
    original_backward = torch.autograd.backward
    for step in range(explored + 2):
        assert_bitwise_equal(expected, train_step(model, _ids(), seed=5))
        if step < explored - 1:
            assert session.mode == "explore" and session.plan is None
            assert torch.autograd.backward is not original_backward  # measured, forward and backward
    plan = session.plan
    assert plan is not None and session.mode == "planned"
    offered = {"keep", "recompute", *(["selective", "offload:disk", "recompute+offload:disk"]
                                      if len(choices) > 2 else [])}
    sampled = set(session._lockstep.sampled_at)
    if len(choices) > 2:  # selective always fits 0.8 here; selective-alt where the budget left room for it too
        assert "selective" in sampled and sampled <= {"selective", "selective-alt"}, sampled
    else:
        assert sampled == set(), sampled
    assert set(plan.profile.choices) == offered | sampled
    assert set(plan.choices) != {"recompute"}, plan.choices  # some blocks kept (or offloaded), not all recomputed
    assert len(session._lockstep.peaks) == explored + 1  # the explored steps, one verified
    assert plan.measured_process_peak is not None and plan.measured_process_peak <= plan.budget
    assert torch.autograd.backward is original_backward  # done measuring
    log = capsys.readouterr().err
    assert "replaced 4 region(s) (4 acshim: recompute) by the plan" in log
    assert "the plan's step peaked at" in log and "within it" in log


def test_a_verified_step_over_the_budget_is_solved_again_with_the_error_as_room(one_rank_as_sharded,
                                                                              monkeypatch, capsys) -> None:
    model = _model()
    acshim.apply_checkpointing(model)
    session = PlanSession(0.8, choices=("keep", "recompute")).start()
    one_rank_as_sharded.append(session)
    for _ in range(lockstep.EXPLORE_STEPS + 1):  # explored, then the plan's first step
        train_step(model, _ids(), seed=5)
    first = session.plan
    finish = lockstep.StepPeak.finish

    def over_budget(self: lockstep.StepPeak) -> int:  # the plan's first step measured 1 MiB over the budget
        finish(self)
        return first.budget + (1 << 20)

    monkeypatch.setattr(lockstep.StepPeak, "finish", over_budget)
    kept = first.choices.count("keep")
    assert kept >= 1, first.choices
    train_step(model, _ids(), seed=5)  # solved again before it ran
    monkeypatch.setattr(lockstep.StepPeak, "finish", finish)
    again = session.plan
    assert again is not first and again.choices.count("keep") < kept, (first.choices, again.choices)
    assert again.overhead == first.budget + (1 << 20) - first.peak  # what the prediction missed
    assert any("solved again after a step measured" in note for note in again.notes)
    assert "solved again with the error added" in capsys.readouterr().err


def test_a_budget_below_the_least_plan_is_refused_after_the_explored_steps(one_rank_as_sharded) -> None:
    model = _model()
    acshim.apply_checkpointing(model)
    session = PlanSession("1MiB").start()
    one_rank_as_sharded.append(session)
    # the least-memory steps only: recompute's, the offloaded one's and the sampled one's are each
    # predicted over 1 MiB, so they are skipped and the refusal comes with the next step
    for _ in range(lockstep.EXPLORE_STEPS):
        train_step(model, _ids(), seed=5)
    with pytest.raises(session_module.PlanExit, match=r"below the least any plan of keep, recompute, "
                                                      r"recompute\+offload:disk needs: .* pass --budget [\d.]+MiB or "
                                                      r"more") as caught:
        train_step(model, _ids(), seed=5)
    assert caught.value.code == 2
    assert region.ROUTERS == []


def test_selective_choices_are_sampled_on_one_block_of_each_kind_and_planned_bitwise(one_rank_as_sharded,
                                                                                    monkeypatch) -> None:
    """The sampled step runs the last block selective, the one before it selective-alt and the rest
    recomputed; the other blocks take the sampled block's difference from recompute, so the solver
    can plan selective-op on a sharded model. Every step, the sampled and the planned ones included,
    gives no checkpointing's gradients bitwise (dropout on)."""
    expected = train_step(_model(), _ids(), seed=5)
    model = _model()
    acshim.apply_checkpointing(model)
    session = PlanSession(0.8, choices=("keep", "selective", "selective-alt")).start()
    one_rank_as_sharded.append(session)
    explored = lockstep.explore_steps(session)
    assert explored == lockstep.EXPLORE_STEPS + 1  # the recomputed steps, then the sampled one
    plans = []
    # until the plan is verified (one measured over the budget is solved again for the next step)
    for _ in range(explored + 2 + session.retries):
        assert_bitwise_equal(expected, train_step(model, _ids(), seed=5))
        if session.plan is not None and session.plan not in plans:
            plans.append(session.plan)
        if plans and session._lockstep.measuring is None:
            break
    planner, plan = session._lockstep, plans[0]
    # one block each, the last ones (their saved tensors are freed first in backward), as many
    # choices as the budget left room for: selective first
    offered = [choice for choice in plan.profile.choices if choice.startswith("selective")]
    assert offered in (["selective"], ["selective", "selective-alt"]), plan.profile.choices
    assert {choice: sorted(at.values()) for choice, at in planner.sampled_at.items()} == {
        choice: [3 - position] for position, choice in enumerate(offered)}
    for block in plan.profile.blocks:  # a selective block holds its input, as recompute, and less than keep
        assert block.held["recompute"] <= block.held["selective"] <= block.held["keep"], block
        assert block.seconds["keep"] <= block.seconds["selective"] <= block.seconds["recompute"], block
    assert plan.measured_process_peak is not None  # the first plan ran and was measured
    # whichever the solver chose on this machine's timings, a plan of the sampled choices runs exactly
    # on the sharded path (run_choice), the sampled blocks' and the others alike
    assert planner.measuring is None  # done measuring
    session.plan = Plan.from_choices(plans[-1], ["selective", offered[-1], "selective", "recompute"])
    made = []
    contexts = selective.create_selective_checkpoint_contexts
    monkeypatch.setattr(selective, "create_selective_checkpoint_contexts",
                        lambda *args, **kwargs: made.append(1) or contexts(*args, **kwargs))
    for _ in range(2):
        assert_bitwise_equal(expected, train_step(model, _ids(), seed=5))
    assert len(made) == 2 * 3, made  # three selective blocks a step, each through torch's selective checkpoint
