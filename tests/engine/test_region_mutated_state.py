"""State a region's forward changes (issue 16 item 3): the recompute sees it as the forward saw it,
and each step leaves it as one forward without checkpointing does.

Spectral norm (both APIs: its power iteration updates ``u``/``v`` in every training forward), a
buffer updated in place and used after the update, a buffer reassigned to a new tensor, an integer
counter, BatchNorm: every kind of region (module or closure, reentrant or not, selective, nested,
the DeepSpeed / FairScale / torch ``checkpoint_wrapper`` facades, ``apply_checkpointing``), one
module shared by two regions, two optimizer steps: gradients, buffers and loss bitwise equal."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import acshim
import acshim.selective
from acshim.testing import assert_bitwise_equal

WIDTH = 6


class InPlaceAverage(nn.Module):
    """A running average updated in place, then used by the output (what the forward saw)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("average", torch.zeros(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        with torch.no_grad():
            self.average.mul_(0.5).add_(h.mean(0), alpha=0.5)
        return (h - self.average).tanh()


class Reassigned(nn.Module):
    """A buffer replaced by a new tensor in every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("scale", torch.ones(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.scale = self.scale * 0.75 + x.detach().abs().mean(0) * 0.25
        return self.linear(x * self.scale).sin()


class Counter(nn.Module):
    """An integer step counter, bumped in place, that scales the output."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        return self.linear(x).tanh() * (1.0 + 0.25 * self.steps)


STATEFUL: dict[str, Callable[[], nn.Module]] = {
    "spectral_norm": lambda: nn.Sequential(nn.utils.spectral_norm(nn.Linear(WIDTH, WIDTH)), nn.Tanh()),
    "parametrizations.spectral_norm": lambda: nn.Sequential(
        nn.utils.parametrizations.spectral_norm(nn.Linear(WIDTH, WIDTH)), nn.Tanh()),
    "in_place_average": InPlaceAverage,
    "reassigned": Reassigned,
    "counter": Counter,
    "batchnorm": lambda: nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.Tanh()),
}


def _deepspeed(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    from acshim.facades import deepspeed

    return deepspeed.checkpointing.checkpoint(block, x)


def _nested(block: nn.Module, x: torch.Tensor, outer_reentrant: bool) -> torch.Tensor:
    return acshim.checkpoint(lambda t: acshim.checkpoint(block, t, use_reentrant=not outer_reentrant) * 1.0,
                             x, use_reentrant=outer_reentrant)


CALLS: dict[str, Callable[[nn.Module, torch.Tensor], torch.Tensor]] = {
    "non_reentrant": lambda block, x: acshim.checkpoint(block, x, use_reentrant=False),
    "reentrant": lambda block, x: acshim.checkpoint(block, x, use_reentrant=True),
    "closure_non_reentrant": lambda block, x: acshim.checkpoint(lambda t: block(t), x, use_reentrant=False),
    "closure_reentrant": lambda block, x: acshim.checkpoint(lambda t: block(t), x, use_reentrant=True),
    "selective": lambda block, x: acshim.checkpoint(block, x, context_fn=acshim.selective.save_ops()),
    "nested_reentrant_in_non_reentrant": functools.partial(_nested, outer_reentrant=False),
    "nested_non_reentrant_in_reentrant": functools.partial(_nested, outer_reentrant=True),
    "deepspeed": _deepspeed,
}
"""Regions made per call; the others below turn the blocks into regions in place."""


def _fairscale(net: Net) -> None:
    from acshim.facades.fairscale.nn.checkpoint import checkpoint_wrapper

    net.blocks = nn.ModuleList(checkpoint_wrapper(block) for block in net.blocks)


def _torch_wrapper(net: Net, reentrant: bool) -> None:
    from acshim.facades.torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    impl = CheckpointImpl.REENTRANT if reentrant else CheckpointImpl.NO_REENTRANT
    net.blocks = nn.ModuleList(checkpoint_wrapper(block, checkpoint_impl=impl) for block in net.blocks)


WRAPS: dict[str, Callable[[Any], None]] = {
    "fairscale": _fairscale,
    "checkpoint_wrapper_reentrant": functools.partial(_torch_wrapper, reentrant=True),
    "checkpoint_wrapper_non_reentrant": functools.partial(_torch_wrapper, reentrant=False),
    "apply_reentrant": lambda net: acshim.apply_checkpointing(net, acshim.ByName("blocks.*"), reentrant=True),
    "apply_non_reentrant": lambda net: acshim.apply_checkpointing(net, acshim.ByName("blocks.*")),
}


class Net(nn.Module):
    """Blocks 0, 1 then 0 again (a module shared by two regions), a head."""

    def __init__(self, kind: str, call: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([STATEFUL[kind](), STATEFUL[kind]()])
        self.head = nn.Linear(WIDTH, 2)
        self.call = call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index in (0, 1, 0):
            block = self.blocks[index]
            x = block(x) if self.call is None else self.call(block, x)
        return self.head(x)


def two_steps(kind: str, region: str | None) -> dict[str, torch.Tensor]:
    """Two SGD steps (dropout-free, fixed seed); the state after each: loss, gradients, buffers."""
    torch.manual_seed(0)
    net = Net(kind, CALLS.get(region) if region else None)
    if region in WRAPS:
        WRAPS[region](net)
    net.train()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.randn(5, WIDTH, requires_grad=True)
    state: dict[str, torch.Tensor] = {}
    for step in range(2):
        optimizer.zero_grad(set_to_none=True)
        x.grad = None
        loss = net(x).square().mean()
        loss.backward()
        state[f"loss@{step}"] = loss.detach().clone()
        state[f"grad:input@{step}"] = x.grad.clone()
        for name, parameter in net.named_parameters():
            assert parameter.grad is not None, name
            state[f"grad:{name}@{step}"] = parameter.grad.clone()
        for name, buffer in net.named_buffers():
            state[f"buffer:{name}@{step}"] = buffer.clone()
        optimizer.step()
    return state


def _canonical(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Wrappers add a level to names (``_checkpoint_wrapped_module.``): compare by the block's own."""
    return {key.replace("_checkpoint_wrapped_module.", ""): value for key, value in state.items()}


@pytest.mark.parametrize("region", [*CALLS, *WRAPS])
@pytest.mark.parametrize("kind", list(STATEFUL))
def test_state_changed_in_forward_is_seen_and_updated_once(kind: str, region: str) -> None:
    expected = two_steps(kind, None)
    assert_bitwise_equal(expected, _canonical(two_steps(kind, region)))


def test_the_comparison_sees_state_updated_twice() -> None:
    """Without the engine's snapshot (forward and recompute both update, the recompute from the
    forward's result) the spectral-norm gradients and vectors differ: the test above can fail."""
    expected = two_steps("spectral_norm", None)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(acshim.region_buffers, "as_the_forward_saw_them", lambda changes: _nothing())
        actual = two_steps("spectral_norm", "non_reentrant")
    with pytest.raises(AssertionError, match="tensors differ"):
        assert_bitwise_equal(expected, actual)


def _nothing() -> Any:
    import contextlib

    return contextlib.nullcontext()


def test_held_copies_are_only_of_changed_buffers_and_stepping_out_of_selective_modes() -> None:
    """A constant buffer costs nothing after the forward; a changed one keeps its pre-forward copy
    (the recompute's starting point) until backward. A selective region's clones are not seen by
    its policy (they would be cached and replayed as the region's own operators)."""

    class Constant(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(WIDTH, WIDTH)
            self.register_buffer("table", torch.randn(64, WIDTH))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x) + self.table[:1]

    calls: list[str] = []

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(str(op))
        return torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE

    import torch.utils.checkpoint

    context_fn = functools.partial(torch.utils.checkpoint.create_selective_checkpoint_contexts, policy)
    for block, changed in ((Constant(), 0), (InPlaceAverage(), 1)):
        calls.clear()
        region = acshim.region.RegionCall(block, acshim.RegionOptions(context_fn=context_fn))
        out = torch.utils.checkpoint.checkpoint(region, torch.randn(3, WIDTH, requires_grad=True),
                                                use_reentrant=False, context_fn=context_fn)
        assert len(region.buffer_changes) == changed
        assert not any("clone" in op or "equal" in op for op in calls), calls
        out.sum().backward()
