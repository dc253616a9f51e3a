"""The planner's loss where the script's cannot be called (``planner.planning_loss``), and what the
script's own loss is charged before the planning step measures it (issue 26: README's train.py went
1.15x over its budget on the planning step, its ``square().mean()`` holding two output-sized tensors
beyond the planner's sum)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from acshim.planner.planning_loss import SCRIPT_LOSS_OUTPUTS, planning_loss, script_loss_allowance


def test_a_loss_outside_the_forward_is_charged_output_sized_tensors_until_measured() -> None:
    output = torch.randn(16, 8, requires_grad=True) * 2
    assert script_loss_allowance(output, (torch.randn(16, 8),), {}) == SCRIPT_LOSS_OUTPUTS * 16 * 8 * 4
    assert script_loss_allowance((output.double(), output), (), {}) == SCRIPT_LOSS_OUTPUTS * 16 * 8 * 8  # the first
    assert script_loss_allowance(output.detach(), (), {}) == 0  # nothing for backward to reach


def test_a_models_own_loss_and_language_model_logits_are_planned_as_the_script_computes_them() -> None:
    ids = torch.randint(0, 11, (2, 5))
    logits = torch.randn(2, 5, 11, requires_grad=True)
    own = SimpleNamespace(loss=logits.sum(), logits=logits)
    assert script_loss_allowance(own, (ids,), {}) == 0
    assert planning_loss(own, (ids,), {}) is own.loss
    returned = SimpleNamespace(loss=None, logits=logits)
    assert script_loss_allowance(returned, (), {"input_ids": ids}) == 0
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 11), ids[:, 1:].reshape(-1))
    assert torch.allclose(planning_loss(returned, (), {"input_ids": ids}), expected)
