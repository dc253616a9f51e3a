"""``acshim run --budget``'s engine part with a script's own CPU-offload policy (issue 29 item 2): a
region whose selective-checkpoint policy returns ``MUST_CPU_OFFLOAD`` runs as the script asked on
every step, its offload decisions to the storage tier, and the plan chooses for the other regions
only (in process: the router is undone by ``stop()``; ``acshim run`` itself: tests/cli)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import acshim
from acshim import region
from acshim.planner import measure_step
from acshim.planner.choices import ASKED
from acshim.planner.session import PlanSession
from acshim.selective import OffloadProbe, honour_offload, save_ops
from acshim.storage import boundary_offload
from acshim.testing import assert_bitwise_equal, seeded, train_step

pytestmark = pytest.mark.skipif(not hasattr(CheckpointPolicy, "MUST_CPU_OFFLOAD"),
                                reason=f"absent upstream: torch {torch.__version__} has no MUST_CPU_OFFLOAD")

MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
BLOCKS = 6


def _offload_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_CPU_OFFLOAD if op in MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


class Mixed(nn.Module):
    """Identical blocks (same code, parameters and input shapes): the even ones checkpointed with an
    offload policy, the odd ones plainly (a recompute the plan may replace)."""

    def __init__(self, scope=None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Dropout(0.1), nn.Linear(128, 32))
                                    for _ in range(BLOCKS))
        policy = functools.partial(create_selective_checkpoint_contexts, _offload_matmuls)
        self.context_fn = honour_offload(policy, scope) if scope is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, block in enumerate(self.blocks):
            if self.context_fn is None:  # the reference: no checkpointing
                x = x + block(x)
            elif index % 2 == 0:
                x = x + acshim.checkpoint(block, x, use_reentrant=False, context_fn=self.context_fn)
            else:
                x = x + acshim.checkpoint(block, x, use_reentrant=False)
        return x


def _x() -> torch.Tensor:
    return torch.randn(64, 32, generator=torch.Generator().manual_seed(3))


def test_offload_policy_regions_run_as_asked_every_step_the_plan_chooses_for_the_rest() -> None:
    expected = train_step(seeded(Mixed), _x(), seed=5)
    scope = boundary_offload(storage="host", prefetch=0)  # on CPU: kept in place (the disk tier: tests/cli)
    model = seeded(lambda: Mixed(scope))
    session = PlanSession(0.9, choices=("keep", "selective", "recompute"), memory="tensors").start()
    try:
        assert_bitwise_equal(expected, train_step(model, _x(), seed=5))  # planned inside this step
        plan = session.plan
        assert plan is not None
        assert [choice == ASKED for choice in plan.choices] == [index % 2 == 0 for index in range(BLOCKS)]
        for _ in range(2):  # later steps: the policy's matmul outputs reach the tier every time
            before = scope.stats.saved
            assert_bitwise_equal(expected, train_step(model, _x(), seed=5))
            assert scope.stats.saved - before == 2 * (BLOCKS // 2), plan.choices
        summary = session.summary()
        assert "replaced 3 region(s) (3 acshim: recompute) by the plan (" in summary
        assert "; 3 region(s) (3 acshim: selective) run as the script asked (its offload policy, to the host " \
               "tier, on every step)" in summary
        assert measure_step(model, _x())[1] <= plan.budget
    finally:
        session.stop()
    assert region.ROUTERS == []


def test_probe_tells_an_offloading_policy_from_one_that_does_not() -> None:
    block = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    x = torch.randn(4, 8)
    offloading = functools.partial(create_selective_checkpoint_contexts, _offload_matmuls)
    found = {}
    for name, context_fn in {"offload": offloading, "wrapped": honour_offload(offloading), "saves": save_ops(),
                             "list": functools.partial(create_selective_checkpoint_contexts, list(MATMULS))}.items():
        probe = OffloadProbe.of(context_fn)
        assert probe is not None
        with probe:
            block(x)
        found[name] = probe.offloads
    assert found == {"offload": True, "wrapped": True, "saves": False, "list": False}
    assert OffloadProbe.of(None) is None
    assert OffloadProbe.of(torch.utils.checkpoint.noop_context_fn) is None
