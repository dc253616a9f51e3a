"""What no checkpointing would hold, learnt without holding it: one step on fake tensors.

A fractional budget is a share of the step's peak without checkpointing, and planning must stop
any measurement that goes over the budget, so the budget's bytes must be known before the first
real forward: an LM head's logits and the loss's copy of them can alone be more than the budget
(PEFT-style fine-tuning: 0.74x of no checkpointing or more). ``step_peak`` runs one training step
of the model under torch's ``FakeTensorMode`` (shapes and dtypes only, nothing allocated: the
parameters, buffers and inputs are fake copies, through ``torch.func.functional_call``) with every
region run as a plain call, and tracks the live fake storages as ``tracker.LiveBytes`` tracks real
ones: the step's high-water mark without checkpointing, and its forward's. Models whose forward
depends on values (``.item()``, data-dependent shapes) cannot run on fake tensors: ``None`` then.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .planning_loss import planning_loss
from .routing import Mode, PlanningContext
from .tracker import LiveBytes, storage_key


@dataclass
class FakeStep:
    """Bytes no checkpointing would hold: ``forward`` (its forward's high-water mark) and ``peak``
    (the whole step's), activations only (parameters, inputs and gradients left out)."""

    forward: int
    peak: int


def step_peak(session: PlanningContext, root: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
              loss_fn: Callable[[Any], torch.Tensor] | None) -> FakeStep | None:
    """One step without checkpointing on fake tensors (see the module docstring), or None."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call
    from torch.utils._pytree import tree_flatten, tree_map

    try:
        with FakeTensorMode() as mode:
            def fake(value: Any) -> Any:
                if not isinstance(value, torch.Tensor):
                    return value
                copy = mode.from_tensor(value)
                return copy.requires_grad_(value.requires_grad) if value.is_leaf else copy

            state = {name: fake(tensor) for name, tensor in [*root.named_parameters(), *root.named_buffers()]}
            fake_args, fake_kwargs = tree_map(fake, (args, kwargs))
            leaves = [*state.values(), *tree_flatten((fake_args, fake_kwargs))[0]]
            excluded = {key[0] for leaf in leaves if isinstance(leaf, torch.Tensor) and (key := storage_key(leaf))}
            tracker = LiveBytes(excluded)
            with session.routing(Mode.PLAIN), tracker:
                session.position = 0
                output = functional_call(root, state, fake_args, fake_kwargs)
                loss = loss_fn(output) if loss_fn is not None else planning_loss(output, fake_args, fake_kwargs)
                del output
                tracker.mark("forward")
                loss.backward()
                del loss
                tracker.mark("end")
            grads = {key[0] for tensor in state.values() if tensor.grad is not None
                     and (key := storage_key(tensor.grad))}
            series = tracker.series(grads)
            tracker.release()
    except Exception:  # a forward that depends on values, or an operator without a fake kernel
        return None
    forward = max(series[:tracker.marks["forward"]], default=0)
    return FakeStep(forward, max(series, default=0))
