"""Stand-ins for the blocks, so the part of a model outside them can be measured alone.

The planner needs the memory and time of what lies outside the blocks (embeddings, head, loss inside
the forward), kept and offloaded. Running the whole model for each would cost a training step each
(with the blocks recomputed, more); instead each block returns the output it gave in the profiling
step, through an autograd node that saves nothing and hands a gradient of the right shape to its
inputs, so forward and backward go through the outside part as in the model at a fraction of a
step's cost. Written by hand: no torch utility replays a module's recorded output.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .. import structures
from .tracker import storage_key


class _ReplayOutput(torch.autograd.Function):
    """``forward(count, anchor, *inputs_then_outputs)``: copies of the outputs; backward gives each
    input the incoming gradient of the same shape when there is one, else zeros."""

    @staticmethod
    def forward(ctx: Any, count: int, anchor: torch.Tensor, *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        inputs, outputs = values[:count], values[count:]
        ctx.inputs = [(t.shape, t.dtype, t.device) for t in inputs]
        ctx.count, ctx.outputs = count, len(outputs)
        copies = tuple(t.clone() for t in outputs)
        ctx.mark_non_differentiable(*[t for t in copies if not (t.is_floating_point() or t.is_complex())])
        return copies

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        given = [g for g in grads if g is not None]
        out = []
        for shape, dtype, device in ctx.inputs:
            match = next((g for g in given if g.shape == shape and g.dtype == dtype), None)
            out.append(match if match is not None else torch.zeros(shape, dtype=dtype, device=device))
        return (None, None, *out, *([None] * ctx.outputs))


def replay(recorded: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A block's recorded output for a call on ``args``/``kwargs``, connected to them for backward."""
    inputs = [leaf for leaf in structures.flatten((args, kwargs))[0]
              if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
    leaves, rebuild = structures.flatten(recorded)
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    if not tensors:
        return recorded
    # The anchor makes the outputs require grad even when no input does (the block's parameters did).
    anchor = torch.zeros((), requires_grad=torch.is_grad_enabled())
    copies = iter(_ReplayOutput.apply(len(inputs), anchor, *inputs, *tensors))
    return rebuild([next(copies) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves])


class Copies:
    """Detached copies of the blocks' inputs and outputs, made outside any tracker, one per tensor:
    a block's output is usually the next block's input, and copying it twice would double what
    profiling holds."""

    def __init__(self) -> None:
        self._made: dict[int, tuple[weakref.ref[torch.Tensor], int, torch.Tensor]] = {}

    def __call__(self, value: Any) -> Any:
        leaves, rebuild = structures.flatten(value)
        with _disable_current_modes():
            return rebuild([self._copy(leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves])

    def _copy(self, tensor: torch.Tensor) -> torch.Tensor:
        made = self._made.get(id(tensor))
        if made is not None and made[0]() is tensor and made[1] == tensor._version:  # not changed in place since
            return made[2]
        copy = tensor.detach().clone()
        self._made[id(tensor)] = (weakref.ref(tensor), tensor._version, copy)
        return copy


def recorded_keys(recorded: Any) -> set[int]:
    """Storage ids of the tensors in ``recorded`` outputs: the tracker leaves them out (they exist
    before the step; ``replay`` copies them, and the copies are the block's output)."""
    return {key[0] for leaf in structures.flatten(recorded)[0]
            if isinstance(leaf, torch.Tensor) and (key := storage_key(leaf))}
