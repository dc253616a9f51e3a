"""Reentrant regions and the leaves their outputs depend on (issue 16 items 4 and 9).

- ``.grad()`` / ``backward(inputs=...)`` through any reentrant region gives torch's reentrant
  error, also when the region is a closure whose weights are no input of it (it silently left the
  gradient None);
- the forward runs with grad enabled (saving nothing), so it takes the kernels of the run without
  checkpointing (CPU ``nn.LSTM`` differed by up to 1.2e-7 under ``no_grad``);
- a weight used by several uses in several reentrant regions gets bitwise the gradient one backward
  forms (it was summed per region), and hooks on a leaf fire once;
- an input the forward changes in place gives torch's in-place error (the recompute started from
  the changed values, silently).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import acshim
from acshim.region import REENTRANT_GRAD_ERROR

torch.manual_seed(0)
LIN1 = nn.Linear(4, 4)  # a module the closures below reach as a global


def _deepspeed(function: Callable[..., Any], *args: Any) -> Any:
    from acshim.facades import deepspeed

    return deepspeed.checkpointing.checkpoint(function, *args)


def _fairscale(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    from acshim.facades.fairscale.nn.checkpoint import checkpoint_wrapper

    return checkpoint_wrapper(module)(x)


def _torch_wrapper(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    from acshim.facades.torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    return checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.REENTRANT)(x)


def _apply(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    holder = nn.Sequential(module)
    acshim.apply_checkpointing(holder, acshim.ByName("0"), reentrant=True)
    return holder(x)


def _reentrant(function: Callable[..., Any], *args: Any) -> Any:
    return acshim.checkpoint(function, *args, use_reentrant=True)


REGIONS: dict[str, Callable[[nn.Module, torch.Tensor], torch.Tensor]] = {
    "module": lambda lin, x: _reentrant(lin, x),
    "closure_over_global_module": lambda lin, x: _reentrant(lambda t: LIN1(t).tanh(), x),
    "closure_over_local_module": lambda lin, x: _reentrant(lambda t: lin(t).tanh(), x),
    "closure_over_weight_tensor": lambda lin, x: _reentrant(lambda t: (t @ lin.weight.t()).tanh(), x),
    "partial": lambda lin, x: _reentrant(functools.partial(torch.nn.functional.linear, weight=lin.weight), x),
    "bound_method": lambda lin, x: _reentrant(lin.forward, x),
    "deepspeed_closure": lambda lin, x: _deepspeed(lambda t: lin(t).tanh(), x),
    "deepspeed_module": lambda lin, x: _deepspeed(lin, x),
    "fairscale": _fairscale,
    "torch_checkpoint_wrapper": _torch_wrapper,
    "apply_checkpointing": _apply,
}
"""A reentrant region over ``lin`` (``LIN1`` for the global closure) of every shape the engine meets."""


def _target(name: str, lin: nn.Module) -> nn.Module:
    return LIN1 if name == "closure_over_global_module" else lin


@pytest.mark.parametrize("x_requires_grad", [True, False])
@pytest.mark.parametrize("how", ["backward_inputs", "autograd_grad"])
@pytest.mark.parametrize("name", list(REGIONS))
def test_grad_and_backward_inputs_through_every_reentrant_region_raise_torchs_error(
        name: str, how: str, x_requires_grad: bool) -> None:
    torch.manual_seed(0)
    lin, lin2 = nn.Linear(4, 4), nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=x_requires_grad)
    h = REGIONS[name](lin, x)
    loss = lin2(h).pow(2).sum()
    weight = _target(name, lin).weight
    wording = "Checkpointing is not compatible with .grad()" if name.startswith(("deepspeed", "fairscale")) else \
        REENTRANT_GRAD_ERROR[:60]
    with pytest.raises(RuntimeError, match=wording.replace("(", r"\(").replace(")", r"\)")):
        if how == "backward_inputs":
            loss.backward(inputs=[weight])
        else:
            torch.autograd.grad(loss, [weight])


@pytest.mark.parametrize("name", list(REGIONS))
def test_plain_backward_through_every_reentrant_region_is_exact(name: str) -> None:
    torch.manual_seed(0)
    lin, lin2 = nn.Linear(4, 4), nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)

    def step(region: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
        for module in (lin, lin2, LIN1):
            module.zero_grad(set_to_none=True)
        x.grad = None
        lin2(region(lin, x)).pow(2).sum().backward()
        return [x.grad.clone(), *(p.grad.clone() for p in (*_target(name, lin).parameters(), *lin2.parameters())
                                   if p.grad is not None)]

    plain = {
        "module": lambda lin, x: lin(x), "bound_method": lambda lin, x: lin(x),
        "deepspeed_module": lambda lin, x: lin(x), "fairscale": lambda lin, x: lin(x),
        "torch_checkpoint_wrapper": lambda lin, x: lin(x), "apply_checkpointing": lambda lin, x: lin(x),
        "partial": lambda lin, x: torch.nn.functional.linear(x, weight=lin.weight),
        "closure_over_weight_tensor": lambda lin, x: (x @ lin.weight.t()).tanh(),
        "closure_over_global_module": lambda lin, x: LIN1(x).tanh(),
    }.get(name, lambda lin, x: lin(x).tanh())
    expected = step(plain)
    actual = step(REGIONS[name])
    assert len(actual) == len(expected) >= 3
    assert all(torch.equal(a, e) for a, e in zip(actual, expected))


# --------------------------------------------------------------------------------------------------
# item 9: kernels and sums


class LSTMOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 8, num_layers=2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(x)[0]


def _lstm_step(region: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    module = LSTMOutput()
    x = torch.randn(2, 5, 8, requires_grad=True)
    out = module(x) if region is None else region(module, x)
    out.square().sum().backward()
    return [x.grad, *(p.grad for p in module.parameters())]


@pytest.mark.parametrize("dialect", ["acshim", "acshim_closure", "deepspeed", "fairscale"])
def test_lstm_in_a_reentrant_region_takes_the_kernels_of_the_plain_run(dialect: str) -> None:
    region = {"acshim": lambda m, x: _reentrant(m, x), "acshim_closure": lambda m, x: _reentrant(lambda t: m(t), x),
              "deepspeed": lambda m, x: _deepspeed(m, x), "fairscale": _fairscale}[dialect]
    expected = _lstm_step(None)
    actual = _lstm_step(region)
    assert all(torch.equal(a, e) for a, e in zip(actual, expected))


def test_reentrant_forward_kernels_differ_under_no_grad() -> None:
    """Why the forward runs with grad enabled: CPU LSTM's no-grad path gives other outputs."""
    torch.manual_seed(0)
    lstm = nn.LSTM(8, 8, batch_first=True)
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        no_grad = lstm(x)[0]
    assert not torch.equal(no_grad, lstm(x)[0])


class Twice(nn.Module):
    """Runs a shared layer twice."""

    def __init__(self, shared: nn.Module) -> None:
        super().__init__()
        self.shared = shared
        self.own = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(self.own(self.shared(x).tanh())).tanh()


@pytest.mark.parametrize("region", ["reentrant", "deepspeed", "mixed"])
def test_weight_shared_by_reentrant_regions_is_summed_as_one_backward_sums_it(region: str) -> None:
    """A layer used twice in each of two reentrant regions and once outside them: five uses, added
    in one backward's order (it was (b2 + b1) + (a2 + a1) + c)."""
    torch.manual_seed(0)
    shared = nn.Linear(8, 8)
    blocks = [Twice(shared), Twice(shared)]
    x = torch.randn(4, 8, requires_grad=True)
    hooks: list[int] = []
    shared.weight.register_post_accumulate_grad_hook(lambda p: hooks.append(1))

    def step(call: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
        for module in (shared, *blocks):
            module.zero_grad(set_to_none=True)
        x.grad = None
        hooks.clear()
        h = call(blocks[1], call(blocks[0], x))
        shared(h).square().sum().backward()
        assert hooks == [1]  # one accumulation, as without checkpointing
        return [x.grad.clone(), *(p.grad.clone() for m in (shared, *blocks) for p in m.parameters())]

    expected = step(lambda block, h: block(h))
    calls = {"reentrant": lambda block, h: _reentrant(block, h),
             "deepspeed": lambda block, h: _deepspeed(lambda t: block(t), h),
             "mixed": lambda block, h: (_reentrant(block, h) if block is blocks[0]
                                        else acshim.checkpoint(block, h, use_reentrant=False))}
    assert all(torch.equal(a, e) for a, e in zip(step(calls[region]), expected))


def test_hooks_on_a_closure_tensor_fire_once_and_its_gradient_is_exact() -> None:
    """A tensor a closure captures (not a module parameter) is an input of the region too: its
    gradient reaches it through the outer backward, once, summed as one backward sums it."""
    torch.manual_seed(0)
    weight = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    fired: list[int] = []
    accumulator = weight.view_as(weight).grad_fn.next_functions[0][0]
    accumulator.register_hook(lambda *args: fired.append(1))  # a node hook, like DDP's reducer

    def layer(t: torch.Tensor) -> torch.Tensor:
        return (t @ weight).tanh() @ weight

    def step(region: Callable[..., Any]) -> list[torch.Tensor]:
        weight.grad = x.grad = None
        fired.clear()
        (region(region(x)).square().sum() + weight.sum()).backward()
        assert fired == [1]
        return [weight.grad.clone(), x.grad.clone()]

    expected = step(layer)
    assert all(torch.equal(a, e) for a, e in zip(step(lambda t: _reentrant(layer, t)), expected))


@pytest.mark.parametrize("requires_grad", [True, False])
def test_input_changed_in_place_by_the_forward_gives_torchs_error(requires_grad: bool) -> None:
    """The recompute starts from the region's inputs: one the forward changed in place would be
    recomputed from the changed values (torch's reentrant checkpoint does so silently)."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    base = torch.randn(3, 4, requires_grad=requires_grad)

    def changes_its_input(h: torch.Tensor) -> torch.Tensor:
        h.mul_(2)
        return lin(h).tanh()

    out = _reentrant(changes_its_input, base * 1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation.*is at version 1; expected version 0"):
        out.sum().backward()
