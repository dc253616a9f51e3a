"""Selective-op checkpointing: saved operators are not recomputed, gradients stay exact."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import acshim
from acshim.selective import resolve_op, save_ops
from acshim.testing import GPT, assert_bitwise_equal, seeded, train_step


def _loss(output: torch.Tensor) -> torch.Tensor:
    return output


def test_saving_matmuls_is_exact_and_holds_between_full_and_none() -> None:
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    plain = train_step(seeded(GPT), ids, loss_fn=_loss)
    held = {"none": acshim.measure_memory(seeded(GPT), ids, loss_fn=_loss).held_bytes}
    for name, changes in (("full", {}), ("selective", {"context_fn": save_ops()})):
        model = seeded(GPT)
        acshim.apply_checkpointing(model, **changes)
        assert_bitwise_equal(plain, train_step(model, ids, loss_fn=_loss))
        model = seeded(GPT)
        acshim.apply_checkpointing(model, **changes)
        held[name] = acshim.measure_memory(model, ids, loss_fn=_loss).held_bytes
    assert held["full"] < held["selective"] < held["none"]


class ThreeMatmuls(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(16, 16, bias=False) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in (self.a, self.b, self.c):
            x = torch.tanh(layer(x))
        return x


class Checkpointed(nn.Module):
    def __init__(self, inner: nn.Module, context_fn) -> None:
        super().__init__()
        self.inner, self.context_fn = inner, context_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return acshim.checkpoint(self.inner, x, context_fn=self.context_fn)


def test_every_other_matmul_is_recomputed() -> None:
    x = torch.randn(8, 16)
    plain = train_step(seeded(ThreeMatmuls), x)
    held = {}
    for rule, alternate in (("all", []), ("alternate", ["aten.mm.default"])):
        model = Checkpointed(seeded(ThreeMatmuls), save_ops(["aten.mm.default"], recompute_every_other=alternate))
        held[rule] = acshim.measure_memory(model, x, loss_fn=lambda out: out.sum(), backward=False).held_bytes
        step = train_step(model, x)
        assert_bitwise_equal(plain, {k.replace("inner.", ""): v for k, v in step.items()})
    mm_output = 8 * 16 * 4
    assert held["all"] - held["alternate"] == mm_output  # the 2nd of 3 matmuls is no longer kept


def test_policy_alternates_forward_and_recompute_counts() -> None:
    from acshim.selective import _SaveOpsPolicy

    mm = torch.ops.aten.mm.default
    policy = _SaveOpsPolicy(frozenset({mm}), frozenset({mm}))

    class Ctx:
        is_recompute = False

    decisions = [policy(Ctx(), mm) for _ in range(3)]
    Policy = torch.utils.checkpoint.CheckpointPolicy
    assert decisions == [Policy.MUST_SAVE, Policy.PREFER_RECOMPUTE, Policy.MUST_SAVE]
    Ctx.is_recompute = True
    assert [policy(Ctx(), mm) for _ in range(3)] == decisions  # recompute counts separately


def test_bad_operator_names_are_rejected() -> None:
    with pytest.raises(ValueError, match="name one overload, e.g. aten.mm.default"):
        resolve_op(torch.ops.aten.mm)
    with pytest.raises(ValueError, match="unknown operator 'aten.nope.default'"):
        save_ops(["aten.nope.default"])
    with pytest.raises(ValueError, match="at least one operator"):
        save_ops([])
