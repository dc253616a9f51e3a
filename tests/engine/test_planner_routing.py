"""The planner's router (``acshim.planner.routing``): the session's mode is a ``Mode`` that only the
session assigns, and a measurement puts it back however it ends."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import acshim
import acshim.planner
from acshim import region
from acshim.planner.process import ProcessMemory
from acshim.planner.profiler import RegionProfiler
from acshim.planner.routing import Mode, PlanningContext
from acshim.planner.session import PlanSession
from acshim.testing import GPT, assert_bitwise_equal, seeded, train_step


def _model() -> GPT:
    return seeded(lambda: GPT(layers=2, width=32, heads=2, seq=16, vocab=64))


def _ids() -> torch.Tensor:
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))


@pytest.fixture
def planned():
    """A checkpointed model and a session that planned it on its first step (tensors budgeted)."""
    model = _model()
    acshim.apply_checkpointing(model)
    session = PlanSession("16MiB", choices=("keep", "recompute"), memory="tensors")
    assert session.mode is Mode.IDLE
    session.start()
    try:
        train_step(model, _ids(), seed=5)
        yield model, session
    finally:
        session.stop()
    assert region.ROUTERS == []


def test_the_session_plans_into_the_planned_mode_and_offers_what_the_planner_uses(planned) -> None:
    model, session = planned
    assert session.mode is Mode.PLANNED
    assert session.mode == "planned"  # a StrEnum: the former strings still compare equal
    assert isinstance(session, PlanningContext)  # every member the planner's modules use is there


def test_a_verification_that_raises_in_a_region_puts_the_routing_back(planned) -> None:
    """A candidate plan's step that fails inside a region (not over budget: the error propagates)
    leaves the session routing the plan as before, and the next step's gradients are unchanged."""
    model, session = planned
    plan = list(session.plan.choices)
    profiler = RegionProfiler(session, model, (_ids(),), {}, None, ProcessMemory("cpu", enabled=False), 0, None)

    def fail(module, args):
        raise RuntimeError("the block failed")

    hook = model.h[1].fc.register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="the block failed"):
        profiler.verify(["recompute", "keep"], "keep")
    hook.remove()
    assert session.mode is Mode.PLANNED and session.plan.choices == plan
    found = profiler.verify(["recompute", "recompute"], "keep")  # a measurement that ends: the same
    assert found.peak > 0 and session.mode is Mode.PLANNED
    model.zero_grad(set_to_none=True)
    expected = train_step(_model(), _ids(), seed=5)  # no checkpointing
    assert_bitwise_equal(expected, train_step(model, _ids(), seed=5))


def test_only_the_session_assigns_the_mode_or_reads_its_private_state() -> None:
    """The planner's other modules use the session through ``PlanningContext``: none assigns
    ``session.mode`` or touches an underscored attribute of a session."""
    found = []
    for path in sorted(Path(acshim.planner.__file__).parent.glob("*.py")):
        if path.name == "session.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and ast.unparse(node.value).split(".")[-1] == "session" \
                    and (node.attr.startswith("_") or (node.attr == "mode" and isinstance(node.ctx, ast.Store))):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert found == []
