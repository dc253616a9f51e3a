"""``@smp.step`` and ``StepOutput`` (smdistributed.modelparallel.torch.step).

The decorated function runs once per microbatch: tensor arguments (also inside lists, tuples and
dicts, and objects with ``smp_slice(num_mb, mb, axis)``) are split along their batch axis (0, or
``input_split_axes[name]``) into ``microbatches`` equal views; arguments named in
``non_split_inputs`` are passed whole. Gradients that ``model.backward`` accumulates over the
microbatches are divided by the number of microbatches at the end of the step when
``average_grads_across_microbatches`` (the default), as upstream's gradient reducer does, so for a
mean loss the result equals the full-batch gradient up to float rounding. Returned tensors come back
as ``StepOutput`` objects (detached unless ``detach_outputs=False``), containers keep their shape.
The optimizer step stays outside, as upstream requires.

With pipeline partitions across ranks (``pipeline_parallel_degree`` > 1 under a launcher) the
function runs on pp_rank 0 of each model replica, the other stages serving the calls that reach
their modules (``_pipeline_runner``); every rank returns the same ``StepOutput`` values. Each rank
then averages its own parameters' gradients over the microbatches and, with several replicas,
across them (sum over the data-parallel group, then divide by its size).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from acshim import structures

from . import _pipeline_runner as runner_mod
from . import comm
from .exceptions import DistributedModelNotWrappedError, InvalidStepOutputError, TensorSplitError
from .state_mod import state


def divisibility_error(batch_size: int, num_mb: int) -> str:
    return (f"Batch size must be divisible by the number of microbatches. Found batch size={batch_size}, "
            f"number of microbatches={num_mb}. If this is the last batch of the epoch, you can set "
            "drop_last=True in your DataLoader to skip it. If this is a tensor with no batch dimension, name its "
            "argument in 'non_split_inputs' of smp.step; if its batch axis is not 0, give it in 'input_split_axes'.")


class StepOutput:
    """The per-microbatch values of one output of an ``smp.step`` function."""

    def __init__(self, outputs: list[Any] | tuple[Any, ...]) -> None:
        if not isinstance(outputs, (list, tuple)):
            raise InvalidStepOutputError(type(outputs))
        self._outputs = outputs

    @property
    def outputs(self) -> list[Any] | tuple[Any, ...]:
        """One value per microbatch, in microbatch order."""
        return self._outputs

    def __getitem__(self, index: int) -> Any:
        return self._outputs[index]

    def __len__(self) -> int:
        return len(self._outputs)

    def reduce_mean(self) -> Any:
        return sum(self._outputs) / len(self._outputs)

    def reduce_sum(self) -> Any:
        return sum(self._outputs)

    def concat(self) -> torch.Tensor:
        return torch.cat(list(self._outputs), dim=0)

    def stack(self) -> torch.Tensor:
        return torch.stack(list(self._outputs))

    def map(self, func: Callable[[Any], Any]) -> StepOutput:
        """Apply ``func`` to each microbatch's value, in place; returns self."""
        self._outputs = [func(out) for out in self._outputs]
        return self

    def add_output(self, out: Any) -> None:
        self._outputs = [*self._outputs, out]

    def clear(self) -> None:
        self._outputs = []

    def __repr__(self) -> str:
        return f"StepOutput({list(self._outputs)!r})"


def _slice(value: Any, num_mb: int, mb: int, axis: int, splittable: bool) -> Any:
    if hasattr(value, "smp_slice"):
        return value.smp_slice(num_mb, mb, axis)
    if isinstance(value, StepOutput):
        return value.outputs[mb]
    if not splittable or not isinstance(value, torch.Tensor):
        return value
    size = value.size(axis)
    if size % num_mb != 0:
        raise ValueError(divisibility_error(size, num_mb))
    chunk = size // num_mb
    return value.narrow(axis, mb * chunk, chunk)


def _split_value(value: Any, num_mb: int, mb: int, axis: int, splittable: bool) -> Any:
    leaves, rebuild = structures.flatten(value)
    return rebuild([_slice(leaf, num_mb, mb, axis, splittable) for leaf in leaves])


def _as_step_output(outputs: list[Any], detach: bool) -> Any:
    first = outputs[0]
    if isinstance(first, list):
        return [_as_step_output([o[i] for o in outputs], detach) for i in range(len(first))]
    if isinstance(first, tuple):
        return tuple(_as_step_output([o[i] for o in outputs], detach) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: _as_step_output([o[k] for o in outputs], detach) for k in first}
    if isinstance(first, torch.Tensor):
        return StepOutput([o.detach() if detach else o for o in outputs])
    return outputs


class StepFunction:
    """A function decorated with ``@smp.step``."""

    def __init__(self, func: Callable[..., Any], non_split_inputs: Sequence[str] | None = None,
                 input_split_axes: dict[str, int] | None = None, detach_outputs: bool = True) -> None:
        if non_split_inputs is not None and not isinstance(non_split_inputs, list):
            raise TensorSplitError("Non-split inputs must be a list.")
        if input_split_axes is not None and not isinstance(input_split_axes, dict):
            raise TensorSplitError("input_split_axes must be a dict.")
        self.func = func
        self.non_split_inputs = list(non_split_inputs or [])
        self.input_split_axes = dict(input_split_axes or {})
        self.detach_outputs = detach_outputs
        self.arg_names = inspect.getfullargspec(func).args
        unknown = set(self.non_split_inputs) - set(self.arg_names)
        if unknown:
            raise TensorSplitError(f"Non-split inputs list {self.non_split_inputs} contains a non-argument of "
                                   f"{func.__name__}.")
        if set(self.input_split_axes) - set(self.arg_names):
            raise TensorSplitError(f"Input split axes dict {self.input_split_axes} contains a non-argument key of "
                                   f"{func.__name__}.")
        functools.update_wrapper(self, func)

    def _split(self, args: tuple[Any, ...], kwargs: dict[str, Any], num_mb: int, mb: int
               ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        def split(name: str | None, value: Any) -> Any:
            return _split_value(value, num_mb, mb, self.input_split_axes.get(name, 0),
                                name not in self.non_split_inputs)

        names = [self.arg_names[i] if i < len(self.arg_names) else None for i in range(len(args))]
        return (tuple(split(n, v) for n, v in zip(names, args)),
                {k: split(k, v) for k, v in kwargs.items()})

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        cfg = state.require_init()
        model = state.model
        if model is None:
            raise DistributedModelNotWrappedError("calling an smp.step-decorated function")
        num_mb = cfg.microbatches
        microbatch_inputs = [self._split(args, kwargs, num_mb, mb) for mb in range(num_mb)]
        if not model.pipelined:
            model._partition()
        parameters = [p for p in model.parameters() if p.requires_grad]
        earlier_grads = {p: p.grad for p in parameters if p.grad is not None}
        for p in earlier_grads:
            p.grad = None
        if model.pipelined and comm.pp_rank() != 0:
            outputs = model._serve_pipeline_step()
        else:
            outputs = self._run_microbatches(model, microbatch_inputs)
        with torch.no_grad():
            for p in parameters:
                if p.grad is not None and model.average_grads_across_microbatches and num_mb > 1:
                    p.grad.div_(float(num_mb))
            if model.pipelined:
                model._reduce_pipeline_gradients(parameters)
            for p in earlier_grads:
                p.grad = earlier_grads[p] if p.grad is None else earlier_grads[p] + p.grad
        model._after_step()
        return _as_step_output(outputs, self.detach_outputs) if outputs else None

    def _run_microbatches(self, model: Any, microbatch_inputs: list[tuple[tuple[Any, ...], dict[str, Any]]]) -> list[Any]:
        """Run the step function once per microbatch (on the pipeline's driver when partitioned)."""
        outputs: list[Any] = []
        num_mb = len(microbatch_inputs)
        state.in_step_func = True
        try:
            for mb, (mb_args, mb_kwargs) in enumerate(microbatch_inputs):
                state.microbatch = mb
                last = mb == num_mb - 1
                with contextlib.nullcontext() if last else model._without_gradient_sync():
                    outputs.append(self.func(*mb_args, **mb_kwargs))
        except BaseException as error:
            if model.pipelined:
                model._end_pipeline_step(error=f"{type(error).__name__}: {error}",
                                         exit_code=runner_mod.exit_code_of(error))
            raise
        finally:
            state.in_step_func = False
            state.microbatch = 0
        if model.pipelined:
            model._end_pipeline_step(outputs)
        return outputs


def step(func: Callable[..., Any] | None = None, non_split_inputs: Sequence[str] | None = None,
         input_split_axes: dict[str, int] | None = None, detach_outputs: bool = True) -> Any:
    """Decorator, bare (``@smp.step``) or called (``@smp.step(non_split_inputs=[...])``)."""

    def decorate(inner: Callable[..., Any]) -> StepFunction:
        return StepFunction(inner, non_split_inputs=non_split_inputs, input_split_axes=input_split_axes,
                            detach_outputs=detach_outputs)

    return decorate if func is None else decorate(func)

__all__ = ["StepOutput", "step"]
