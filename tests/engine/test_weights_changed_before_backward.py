"""Weights changed between a region's forward and its recompute (issue 28 item 1).

An optimizer step, an EMA or weight-averaging update, or ``p.add_`` under ``no_grad`` between
forward and backward made the recompute run on the new weights: gradients computed from them,
silently, under both modes (torch's own checkpoint does the same). Plain torch raises its in-place
error for a saved weight changed that way, and so must every route into the engine, naming the
tensor. Nothing changed: the same step is bitwise the run without checkpointing.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import acshim
from acshim.testing import assert_bitwise_equal

IN_PLACE_ERROR = "one of the variables needed for gradient computation has been modified by an inplace operation"


class Scaled(nn.Module):
    """A block that reads a buffer as well as its parameters (a frozen scale, an eval-mode statistic)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.drop = nn.Dropout(0.2)
        self.register_buffer("scale", torch.full((16,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.drop(torch.nn.functional.gelu(self.up(x)) * self.scale))


def _deepspeed(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    from acshim.facades import deepspeed

    return deepspeed.checkpointing.checkpoint(block, x)


def _fairscale(offload: bool) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    def run(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        from acshim.facades.fairscale.nn.checkpoint import checkpoint_wrapper

        return checkpoint_wrapper(block, offload_to_cpu=offload)(x)

    return run


def _torch_wrapper(reentrant: bool) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    def run(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        from acshim.facades.torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl,
            checkpoint_wrapper,
        )

        impl = CheckpointImpl.REENTRANT if reentrant else CheckpointImpl.NO_REENTRANT
        return checkpoint_wrapper(block, checkpoint_impl=impl)(x)

    return run


def _apply(**options: Any) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    def run(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        holder = nn.Sequential(block)
        acshim.apply_checkpointing(holder, acshim.ByName("0"), **options)
        try:
            return holder(x)
        finally:
            acshim.remove_checkpointing(holder)  # the region made by the call stays in its graph

    return run


def _checkpoint(reentrant: bool, **options: Any) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    return lambda block, x: acshim.checkpoint(block, x, use_reentrant=reentrant, **options)


def _smp_v1(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    from acshim.facades.smdistributed.modelparallel.torch.patches.checkpoint import checkpoint

    return checkpoint(block, x)


ROUTES: dict[str, Callable[[nn.Module, torch.Tensor], torch.Tensor]] = {
    "checkpoint": _checkpoint(False),
    "checkpoint_reentrant": _checkpoint(True),
    "checkpoint_selective": lambda block, x: acshim.checkpoint(block, x, use_reentrant=False,
                                                               context_fn=acshim.selective.save_ops()),
    "closure": lambda block, x: acshim.checkpoint(lambda t: block(t), x, use_reentrant=False),
    "closure_reentrant": lambda block, x: acshim.checkpoint(lambda t: block(t), x, use_reentrant=True),
    "partial_reentrant": lambda block, x: acshim.checkpoint(functools.partial(block.forward), x, use_reentrant=True),
    "run_region": lambda block, x: acshim.run_region(block, (x,)),
    "apply": _apply(),
    "apply_reentrant": _apply(reentrant=True),
    "apply_selective": _apply(context_fn=acshim.selective.save_ops()),
    "apply_disk": _apply(storage="disk"),
    "deepspeed": _deepspeed,
    "fairscale": _fairscale(False),
    "fairscale_offload": _fairscale(True),
    "torch_checkpoint_wrapper": _torch_wrapper(False),
    "torch_checkpoint_wrapper_reentrant": _torch_wrapper(True),
    "smp_v1": _smp_v1,
}
"""Every route into the engine's regions, over one block (Modalities' and SMP v2's components wrap with
torch's ``checkpoint_wrapper`` above; Hugging Face's in tests/hf/test_weights_changed_before_backward_hf.py)."""


def _add(block: nn.Module) -> None:
    with torch.no_grad():
        for p in block.parameters():
            p.add_(0.01)


def _sgd(block: nn.Module) -> None:
    optimizer = torch.optim.SGD(block.parameters(), lr=0.1, foreach=True)
    for p in block.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    block.zero_grad(set_to_none=True)


def _average(block: nn.Module) -> None:
    """A weight-averaging update written back into the model (SWA/Lookahead style)."""
    averaged = [p.detach() * 0.9 for p in block.parameters()]
    with torch.no_grad():
        torch._foreach_lerp_(list(block.parameters()), averaged, 0.5)


def _buffer(block: nn.Module) -> None:
    block.scale.mul_(2.0)  # type: ignore[operator]


CHANGES: dict[str, Callable[[nn.Module], None]] = {"add_": _add, "sgd_step": _sgd, "averaging": _average,
                                                    "buffer": _buffer}


def _step(route: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None,
          change: Callable[[nn.Module], None] | None, tmp_path: Any) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    block, head = Scaled(), nn.Linear(8, 2)
    x = torch.randn(6, 8, requires_grad=True)
    torch.manual_seed(1)
    with acshim.offload(storage="disk", directory=str(tmp_path)) if route is ROUTES["apply_disk"] else \
            contextlib.nullcontext():
        h = block(x) if route is None else route(block, x)
    loss = head(h).square().mean()
    if change is not None:
        change(block)
    loss.backward()
    return {"grad:x": x.grad, **{f"grad:{n}": p.grad for n, p in block.named_parameters()},
            **{f"grad:head.{n}": p.grad for n, p in head.named_parameters()}}


@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("route", list(ROUTES))
def test_weights_changed_before_backward_give_torchs_in_place_error(route: str, change: str, tmp_path) -> None:
    with pytest.raises(RuntimeError) as raised:
        _step(ROUTES[route], CHANGES[change], tmp_path)
    text = str(raised.value)
    assert text.startswith(IN_PLACE_ERROR), text
    if route not in ("fairscale_offload",):  # the storage tier's own check may see a saved weight first
        what = "buffer 'scale'" if change == "buffer" else "parameter '"
        assert what in text and "before backward recomputed" in text, text


@pytest.mark.parametrize("route", list(ROUTES))
def test_nothing_changed_is_bitwise_the_plain_step(route: str, tmp_path) -> None:
    assert_bitwise_equal(_step(None, None, tmp_path), _step(ROUTES[route], None, tmp_path))


def test_plain_torch_raises_for_the_same_changes(tmp_path) -> None:
    """The reference: without checkpointing, torch itself raises for every change above (each
    changed tensor is saved by some node), so acshim raising is torch's behaviour, not stricter."""
    for change in CHANGES.values():
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            _step(None, change, tmp_path)


def test_a_weight_changed_and_changed_back_before_backward_still_raises(tmp_path) -> None:
    """Values equal again but the version moved: the recompute cannot know (torch neither)."""

    def there_and_back(block: nn.Module) -> None:
        with torch.no_grad():
            block.up.weight.add_(1.0)
            block.up.weight.sub_(1.0)

    with pytest.raises(RuntimeError, match="parameter 'weight' of Linear"):
        _step(ROUTES["checkpoint"], there_and_back, tmp_path)


def test_a_second_backward_after_an_optimizer_step_raises(tmp_path) -> None:
    """``retain_graph=True``, a step, and backward again: the recompute would use the stepped weights."""
    torch.manual_seed(0)
    block = Scaled()
    x = torch.randn(4, 8, requires_grad=True)
    for reentrant in (False, True):
        loss = acshim.checkpoint(block, x, use_reentrant=reentrant).sum()
        loss.backward(retain_graph=True)
        _sgd(block)
        with pytest.raises(RuntimeError, match="before backward recomputed that region"):
            loss.backward()
