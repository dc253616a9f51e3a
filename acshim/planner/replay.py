"""Stand-ins for the blocks, so the part of a model outside them can be measured alone.

The planner needs the memory and time of what lies outside the blocks (embeddings, head, loss inside
the forward), kept and offloaded. Running the whole model for each would cost a training step each
(with the blocks recomputed, more); instead each block returns an output like the one it gave in
the profiling step, through an autograd node that saves nothing and hands a gradient of the right
shape to its inputs, so forward and backward go through the outside part as in the model at a
fraction of a step's cost. ``replay`` returns copies of recorded outputs; ``replay_spec`` builds
them from their shapes alone (``spec_of``): a copy of an input of the same shape (a block's output
is usually its input's shape, and its values keep the outside part's arithmetic realistic) or
zeros, so nothing has to be kept between the profiling step and the replay. Written by hand: no
torch utility replays a module's recorded output.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .. import structures
from .tracker import storage_key


class TensorSpec:
    """What a replayed output tensor must look like (a plain class: ``structures`` would open a
    dataclass as a container)."""

    __slots__ = ("shape", "dtype", "device", "requires_grad")

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, requires_grad: bool) -> None:
        self.shape, self.dtype, self.device, self.requires_grad = shape, dtype, device, requires_grad


def spec_of(output: Any) -> Any:
    """``output`` with every tensor replaced by its ``TensorSpec`` (other leaves kept as they are)."""
    leaves, rebuild = structures.flatten(output)
    return rebuild([TensorSpec(tuple(leaf.shape), leaf.dtype, leaf.device, leaf.requires_grad)
                    if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves])


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
        return (None, None, *_input_grads(ctx.inputs, grads), *([None] * ctx.outputs))


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


class _ReplaySpec(torch.autograd.Function):
    """``forward(specs, count, anchor, *inputs)``: fresh outputs built from ``specs`` (a copy of the
    first input of the same shape and dtype, else zeros); backward as ``_ReplayOutput``."""

    @staticmethod
    def forward(ctx: Any, specs: tuple[TensorSpec, ...], anchor: torch.Tensor, *inputs: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
        ctx.inputs = [(t.shape, t.dtype, t.device) for t in inputs]
        outputs = []
        for spec in specs:
            like = next((t for t in inputs if tuple(t.shape) == spec.shape and t.dtype == spec.dtype), None)
            outputs.append(like.detach().clone() if like is not None
                           else torch.zeros(spec.shape, dtype=spec.dtype, device=spec.device))
        ctx.mark_non_differentiable(*[t for s, t in zip(specs, outputs, strict=True)
                                      if not s.requires_grad or not (t.is_floating_point() or t.is_complex())])
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        return (None, None, *_input_grads(ctx.inputs, grads))


def replay_spec(spec: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """An output shaped as ``spec`` (``spec_of`` a block's output) for a call on ``args``/``kwargs``,
    connected to the inputs that require grad for backward."""
    inputs = [leaf for leaf in structures.flatten((args, kwargs))[0]
              if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
    leaves, rebuild = structures.flatten(spec)
    specs = tuple(leaf for leaf in leaves if isinstance(leaf, TensorSpec))
    if not specs:
        return spec
    anchor = torch.zeros((), requires_grad=torch.is_grad_enabled())
    made = iter(_ReplaySpec.apply(specs, anchor, *inputs))
    return rebuild([next(made) if isinstance(leaf, TensorSpec) else leaf for leaf in leaves])


def _input_grads(inputs: list[tuple[Any, Any, Any]], grads: tuple[torch.Tensor | None, ...]) -> list[torch.Tensor]:
    """A gradient per recorded input ``(shape, dtype, device)``: an output gradient of the same shape
    and dtype where there is one (any will do: the replayed part's numbers are not the point, its
    memory is), else zeros."""
    given = [g for g in grads if g is not None]
    out = []
    for shape, dtype, device in inputs:
        match = next((g for g in given if g.shape == shape and g.dtype == dtype), None)
        out.append(match if match is not None else torch.zeros(shape, dtype=dtype, device=device))
    return out
