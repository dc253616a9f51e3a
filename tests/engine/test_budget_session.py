"""``acshim run --budget``'s engine part: a PlanSession routes a model's own regions by a plan made
on its first step (in process: the router is undone by ``stop()``)."""

from __future__ import annotations

import pytest
import torch

import acshim
from acshim import region
from acshim.planner import measure_step
from acshim.planner.session import PlanExit, PlanSession
from acshim.testing import GPT, assert_bitwise_equal, seeded, train_step


def _model() -> GPT:
    return seeded(lambda: GPT(layers=4, width=64, heads=4, seq=32, vocab=128))


def _ids() -> torch.Tensor:
    return torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(3))


@pytest.fixture
def session_cleanup():
    sessions: list[PlanSession] = []
    yield sessions
    for session in sessions:
        session.stop()
    assert region.ROUTERS == []


@pytest.mark.parametrize("budget", [0.45])
def test_plan_replaces_the_scripts_recompute_gradients_bitwise_and_peak_within_budget(budget, session_cleanup) -> None:
    expected = train_step(_model(), _ids(), seed=5)  # no checkpointing: no region, nothing routed
    model = _model()
    acshim.apply_checkpointing(model)  # the "script's" recipe: full recompute of every block
    session = PlanSession(budget, repeats=1).start()
    session_cleanup.append(session)
    first = train_step(model, _ids(), seed=5)  # planned inside this step's first region call
    assert session.mode == "planned" and session.plan is not None
    assert len(session.plan.choices) == 4 and session.names == ["h.0", "h.1", "h.2", "h.3"]
    assert_bitwise_equal(expected, first)  # the interrupted step continued exactly
    second = train_step(model, _ids(), seed=5)
    assert_bitwise_equal(expected, second)
    held, peak = measure_step(model, _ids())
    assert peak <= session.plan.budget, (peak, session.plan.budget, session.plan.choices)
    assert session.plan.measured_peak <= session.plan.budget
    assert "replaced 4 region(s) (4 acshim: recompute) by the plan" in session.summary()


def test_budget_below_the_minimum_names_it_and_leaves_the_model_as_it_was(session_cleanup) -> None:
    model = _model()
    acshim.apply_checkpointing(model)
    session = PlanSession(1000, choices=("keep", "recompute"), repeats=1).start()
    session_cleanup.append(session)
    with pytest.raises(PlanExit) as caught:
        train_step(model, _ids())
    assert caught.value.code == 2
    assert "--budget 1000" in caught.value.message and "least achievable peak" in caught.value.message
    assert "pass --budget" in caught.value.message
    assert region.ROUTERS == []  # routing undone
    assert all(p.grad is None for p in model.parameters())
    assert acshim.checkpointed_modules(model) == ["h.0", "h.1", "h.2", "h.3"]  # the script's recipe again
    assert_bitwise_equal(train_step(_model(), _ids()), train_step(model, _ids()))


@pytest.mark.parametrize("budget", [0, -1, "abc", "1.5XB", "-2GiB", 1.5])
def test_bad_budgets_are_refused_before_routing(budget) -> None:
    with pytest.raises(ValueError, match=r"--budget"):
        PlanSession(budget).start()
    assert region.ROUTERS == []


def test_region_outside_any_module_forward_is_a_clear_error(session_cleanup) -> None:
    block = torch.nn.Linear(4, 4)
    session = PlanSession(0.5, choices=("recompute",), repeats=1).start()
    session_cleanup.append(session)
    with pytest.raises(PlanExit, match="outside any nn.Module's forward"):
        acshim.checkpoint(lambda x: block(x).relu(), torch.randn(2, 4, requires_grad=True))
    assert region.ROUTERS == []


def test_several_ranks_are_refused_before_anything_is_profiled(session_cleanup, monkeypatch) -> None:
    """Under a process group of several ranks planning is refused (each rank would choose alone and
    profiling's block-alone backwards would fire DDP/FSDP hooks); the script's own recipe is kept."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    model = _model()
    acshim.apply_checkpointing(model)
    session = PlanSession(0.5, repeats=1).start()
    session_cleanup.append(session)
    with pytest.raises(PlanExit, match="under torch.distributed with 2 ranks is not supported yet") as caught:
        train_step(model, _ids())
    assert caught.value.code == 2
    assert region.ROUTERS == []
    assert all(p.grad is None for p in model.parameters())
    assert acshim.checkpointed_modules(model) == ["h.0", "h.1", "h.2", "h.3"]
