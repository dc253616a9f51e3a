"""``smp.DistributedModel`` (smdistributed.modelparallel.torch.model.DistributedModel).

Every rank holds the whole model (one partition). Under a launcher with ``ddp=True`` the forward
runs through torch's DistributedDataParallel, which averages gradients across ranks once per
``smp.step`` (the microbatches but the last run under ``no_sync``). Otherwise the wrapper is transparent: calling it calls the user's module, ``state_dict()`` has the user module's
keys (as upstream, which returns the unwrapped model's full state dict), ``get_module()`` and
``.module`` return the user module. What stays SMP-specific is the contract around ``smp.step``:
``backward`` only inside a step function, ``partitioned`` turning True at the first step,
post-partition hooks called then with ``(model, optimizer)``, and gradients averaged across
microbatches (done by ``smp.step``).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from . import comm
from .exceptions import (
    BwdExecutionNotInStepFnError,
    ModelNotPartitionedError,
    MultipleDistributedModelError,
    SMPUnsupportedError,
)
from .state_mod import state

_SMP_KEYS = ("_smp_is_partial", "_smp_load_info")


class DistributedModel(nn.Module):
    """Wrap the ONE model of the script. Parallelism arguments are accepted and have nothing to do
    in one process; ``average_grads_across_microbatches`` is honoured by ``smp.step``."""

    def __init__(self, module: nn.Module, trace_device: str = "gpu", trace_execution_times: bool = False,
                 trace_memory_usage: bool = False, overlapping_allreduce: bool = True,
                 backward_passes_per_step: int = 1, average_grads_across_microbatches: bool = True,
                 bucket_cap_mb: int = 25, find_unused_parameters: bool = False, broadcast_buffers: bool = True,
                 gradient_as_bucket_view: bool = False) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"smp.DistributedModel wraps an nn.Module, got {type(module).__name__}")
        state.require_init()
        if state.model is not None:
            raise MultipleDistributedModelError()
        if comm.size() > 1 and not state.config().ddp:
            raise SMPUnsupportedError(
                f"smp.DistributedModel with {comm.size()} processes needs data parallelism: set 'ddp': True in the "
                "smp config (acshim keeps the whole model on every rank)")
        super().__init__()
        self.module = module
        # Several ranks: torch's DDP does the all-reduce (as SMP v1 does with ddp=True). Kept out of
        # the module tree so parameters and state_dict keys stay the user module's.
        data_parallel = None
        if comm.size() > 1:
            on_cuda = any(p.is_cuda for p in module.parameters())
            data_parallel = nn.parallel.DistributedDataParallel(
                module, device_ids=[comm.local_rank()] if on_cuda else None, bucket_cap_mb=bucket_cap_mb,
                find_unused_parameters=find_unused_parameters, broadcast_buffers=broadcast_buffers,
                gradient_as_bucket_view=gradient_as_bucket_view)
        object.__setattr__(self, "_data_parallel", data_parallel)
        self.trace_device = trace_device
        self.backward_passes_per_step = backward_passes_per_step
        self.average_grads_across_microbatches = average_grads_across_microbatches
        self._partitioned = False
        self._post_step_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        state.model = self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._data_parallel is not None:
            return self._data_parallel(*args, **kwargs)
        return self.module(*args, **kwargs)

    def _without_gradient_sync(self) -> contextlib.AbstractContextManager[Any]:
        """For every microbatch but the last: accumulate locally, all-reduce once at the end."""
        if self._data_parallel is None:
            return contextlib.nullcontext()
        return self._data_parallel.no_sync()

    def backward(self, tensors: torch.Tensor | Sequence[torch.Tensor],
                 grad_tensors: torch.Tensor | Sequence[torch.Tensor] | None = None) -> None:
        """``torch.autograd.backward(tensors, grad_tensors)``; only inside an ``smp.step`` function."""
        if not state.in_step_func:
            raise BwdExecutionNotInStepFnError()
        torch.autograd.backward(tensors, grad_tensors)

    def get_module(self) -> nn.Module:
        """The user's module, unwrapped."""
        return self.module

    @property
    def partitioned(self) -> bool:
        """True once the first ``smp.step`` call has run (upstream partitions the model then)."""
        return self._partitioned

    def _partition(self) -> None:
        if self._partitioned:
            return
        self._partitioned = True
        for hook in list(state.post_partition_hooks.values()):
            hook(self, state.optimizer)

    def _after_step(self) -> None:
        for hook in list(self._post_step_hooks.values()):
            hook(self, state.optimizer)
        self._post_step_hooks.clear()

    def register_post_partition_hook(self, hook: Callable[..., Any]) -> RemovableHandle | None:
        """Call ``hook(model, optimizer)`` once the model is partitioned (at once if it already is)."""
        return self._register_hook(state.post_partition_hooks, hook)

    def register_post_step_hook(self, hook: Callable[..., Any]) -> RemovableHandle | None:
        """Call ``hook(model, optimizer)`` after the first ``smp.step`` call finishes."""
        return self._register_hook(self._post_step_hooks, hook)

    def _register_hook(self, hooks: dict[int, Callable[..., Any]], hook: Callable[..., Any]) -> RemovableHandle | None:
        """Run ``hook`` now if the first step already happened, else keep it in ``hooks`` until then."""
        if self._partitioned and state.optimizer is not None:
            hook(self, state.optimizer)
            return None
        handle = RemovableHandle(hooks)
        hooks[handle.id] = hook
        return handle

    # -- everything is local in one partition --------------------------------------------------------

    def _require_partitioned(self) -> None:
        if not self._partitioned:
            raise ModelNotPartitionedError()

    def local_modules(self) -> Iterator[nn.Module]:
        self._require_partitioned()
        yield from self.module.modules()

    def local_named_modules(self, memo: set[nn.Module] | None = None, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
        self._require_partitioned()
        yield from self.module.named_modules(memo=memo, prefix=prefix)

    def local_parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        for _, parameter in self.local_named_parameters(recurse=recurse):
            yield parameter

    def local_named_parameters(self, recurse: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        self._require_partitioned()
        yield from self.module.named_parameters(recurse=recurse)

    def local_buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        for _, buffer in self.local_named_buffers(recurse=recurse):
            yield buffer

    def local_named_buffers(self, prefix: str = "", recurse: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        self._require_partitioned()
        yield from self.module.named_buffers(prefix=prefix, recurse=recurse)

    def local_state_dict(self, cast_to_cpu: bool = True, destination: Any = None, prefix: str = "",
                         keep_vars: bool = False) -> dict[str, Any]:
        """The state of this partition: with one partition, the whole user module's."""
        return self.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars, cast_to_cpu=cast_to_cpu)

    def state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False,
                   cast_to_cpu: bool = True, gather_to_rank0: bool = True) -> dict[str, Any]:
        """The user module's state dict (its keys, no wrapper prefix), on CPU unless ``cast_to_cpu=False``."""
        result = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if cast_to_cpu:
            for name, value in result.items():
                if isinstance(value, torch.Tensor) and value.device.type != "cpu":
                    result[name] = value.cpu()
        return result

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load a state dict saved by ``state_dict()``/``local_state_dict()`` (or from the plain model)."""
        cleaned = {k: v for k, v in state_dict.items() if k not in _SMP_KEYS}
        return self.module.load_state_dict(cleaned, strict=strict, assign=assign)

    @contextlib.contextmanager
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True) -> Iterator[None]:
        """Upstream: only with ``ddp=True``; DDP's join for uneven inputs (one process: nothing to join)."""
        if not state.config().ddp:
            raise SMPUnsupportedError("join is only supported when using DDP. Please set ddp=True in SMP config")
        if self._data_parallel is None:
            yield
            return
        with self._data_parallel.join(divide_by_initial_world_size=divide_by_initial_world_size, enable=enable):
            yield

__all__ = ["DistributedModel"]
