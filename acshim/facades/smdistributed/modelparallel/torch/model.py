"""``smp.DistributedModel`` (smdistributed.modelparallel.torch.model.DistributedModel).

With ``pipeline_parallel_degree`` (pp) 1 every rank holds the whole model (one partition). Under a
launcher with ``ddp=True`` the forward then runs through torch's DistributedDataParallel, which
averages gradients across ranks once per ``smp.step`` (the microbatches but the last run under
``no_sync``). Otherwise the wrapper is transparent: calling it calls the user's module,
``state_dict()`` has the user module's keys (as upstream, which returns the unwrapped model's full
state dict), ``get_module()`` and ``.module`` return the user module.

With pp > 1 under a launcher the model is partitioned at its first call inside the first
``smp.step`` (``_partitioning``) and runs on the stage runner (``_pipeline_runner``): every rank
keeps the module objects, but each parameter is computed, updated and saved only by its
partition's rank, and released (an empty tensor) on the others; ``smp.step`` averages the local
gradients across data-parallel replicas; ``state_dict()`` gathers every entry from its owner.

What stays SMP-specific is the contract around ``smp.step``: ``backward`` only inside a step
function, ``partitioned`` turning True at the first step, post-partition hooks called then with
``(model, optimizer)``, and gradients averaged across microbatches (done by ``smp.step``).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from . import _partitioning as partitioning
from . import _pipeline_runner as runner_mod
from . import _pipeline_transport as transport
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
        if comm.dp_size() > 1 and not state.config().ddp:
            raise SMPUnsupportedError(
                f"smp.DistributedModel with {comm.dp_size()} data-parallel replicas needs DDP: set 'ddp': True in "
                "the smp config")
        super().__init__()
        self.module = module
        # Several ranks, one partition: torch's DDP does the all-reduce (as SMP v1 does with ddp=True).
        # Kept out of the module tree so parameters and state_dict keys stay the user module's.
        data_parallel = None
        object.__setattr__(self, "_runner", None)
        if comm.size() > 1 and comm.pp_size() == 1:
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
        if self.pipelined:
            if not state.in_step_func:
                raise SMPUnsupportedError(
                    f"with pipeline_parallel_degree={comm.pp_size()} the model runs across ranks only inside an "
                    "smp.step function: call model(...) from a function decorated with @smp.step")
            self._partition_pipeline(args, kwargs)
        return self.module(*args, **kwargs)

    # -- pipeline parallelism -----------------------------------------------------------------------

    @property
    def pipelined(self) -> bool:
        """True when the model is split into pipeline partitions across ranks."""
        return comm.pp_size() > 1

    @property
    def runner(self) -> runner_mod.StageRunner | None:
        """This rank's stage runner once the model is partitioned (pp > 1), else None."""
        return self._runner

    def _partition_pipeline(self, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> None:
        """Decide (global rank 0, from the first microbatch), share and apply the partition assignment."""
        if self._runner is not None:
            return
        cfg = state.config()
        if comm.rank() == 0:
            if cfg.auto_partition:
                costs = partitioning.measure(self.module, args, kwargs or {})
                partitions = partitioning.auto_assignment(self.module, comm.pp_size(), costs)
            else:
                partitions = partitioning.manual_assignment(self.module, state.placements, cfg.default_partition or 0)
            partitioning.log_assignments(self.module, partitions)
            for other in range(1, comm.size()):
                transport.send(runner_mod.Assignment(partitions), other)
        else:
            _, message = transport.receive(0)
            if isinstance(message, runner_mod.End):
                raise runner_mod.abort(message)
            partitions = message.partitions
        self._apply_partitions(partitions)

    def _apply_partitions(self, partitions: list[int]) -> None:
        from .patches.checkpoint import apply_partitioned_checkpointing

        try:
            runner = runner_mod.StageRunner(self.module, partitions, comm.pp_rank(), comm.pipeline_ranks(),
                                            manual=not state.config().auto_partition)
            for mark in state.checkpoint_marks:
                apply_partitioned_checkpointing(runner, *mark)
        except Exception:
            # every rank applies the same assignment to the same model and meets the same error: none
            # waits for another (``_end_pipeline_step`` sends nothing)
            object.__setattr__(self, "_partition_failed", True)
            raise
        object.__setattr__(self, "_runner", runner)
        state.checkpoint_marks.clear()
        runner_mod.install(runner)
        if state.optimizer is not None:
            state.optimizer._keep_local_parameters(self)
        runner.release_other_partitions()
        self._partition()

    def _serve_pipeline_step(self) -> list[Any]:
        """A stage other than the driver: take the partition if needed, serve until the step ends,
        and return the driver's outputs (one per microbatch)."""
        if self._runner is None:
            self._partition_pipeline()
        end = self._runner.serve_step()
        torch.set_rng_state(end.rng)
        return transport.unpack(end.outputs, end.tensors) or []

    def _end_pipeline_step(self, outputs: Any = None, error: str | None = None, exit_code: int | None = None) -> None:
        """The driver: end the step on every other stage (with the outputs, or the error met and the
        exit code it ends the process with, if any)."""
        if getattr(self, "_partition_failed", False):
            return
        if self._runner is not None:
            self._runner.end_step(outputs, error, exit_code)
            return
        message = runner_mod.End(error=error or "the smp.step function never called the model", exit_code=exit_code)
        for rank in comm.pipeline_ranks()[1:]:
            transport.send(message, rank)
        if error is None:
            raise SMPUnsupportedError("an smp.step function must call the model when pipeline_parallel_degree > 1")

    def _reduce_pipeline_gradients(self, parameters: list[nn.Parameter]) -> None:
        """After a pipelined step: refuse gradients that reached a parameter on a rank that does not own
        it (its module's forward was bypassed), then average the owned ones across replicas."""
        if self._runner is None:
            return
        names = {p: n for n, p in self.module.named_parameters()}
        for parameter in parameters:
            if parameter.grad is not None and not self._runner.is_local_parameter(parameter):
                raise RuntimeError(
                    f"parameter {names.get(parameter, '?')} lives on partition {self._runner.parameter_stage[parameter]} "
                    f"but got a gradient on partition {self._runner.stage}: code there used it without calling its "
                    "module; call the module, or place the code's module on the parameter's partition")
        replicas = comm.dp_size()
        if replicas == 1:
            return
        group = comm.get_dp_process_group()
        for parameter in parameters:
            if parameter.grad is not None:
                torch.distributed.all_reduce(parameter.grad, group=group)
                parameter.grad.div_(float(replicas))

    def _is_local_parameter(self, parameter: nn.Parameter) -> bool:
        return self._runner is None or self._runner.is_local_parameter(parameter)

    def _local_keys(self) -> set[str]:
        """State-dict keys of this rank's partition (every key with one partition)."""
        keys = set(self.module.state_dict(keep_vars=True))
        if self._runner is None:
            return keys
        local = set()
        for name, module in self.module.named_modules():
            if self._runner.partition[module] != self._runner.stage:
                continue
            prefix = f"{name}." if name else ""
            local.update(prefix + n for n, _ in module.named_parameters(recurse=False))
            local.update(prefix + n for n, _ in module.named_buffers(recurse=False))
        return keys & local

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

    def _is_local_module(self, module: nn.Module) -> bool:
        return self._runner is None or self._runner.partition[module] == self._runner.stage

    def local_modules(self) -> Iterator[nn.Module]:
        for _, module in self.local_named_modules():
            yield module

    def local_named_modules(self, memo: set[nn.Module] | None = None, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
        self._require_partitioned()
        for name, module in self.module.named_modules(memo=memo, prefix=prefix):
            if self._is_local_module(module):
                yield name, module

    def local_parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        for _, parameter in self.local_named_parameters(recurse=recurse):
            yield parameter

    def local_named_parameters(self, recurse: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        self._require_partitioned()
        for name, parameter in self.module.named_parameters(recurse=recurse):
            if self._is_local_parameter(parameter):
                yield name, parameter

    def local_buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        for _, buffer in self.local_named_buffers(recurse=recurse):
            yield buffer

    def local_named_buffers(self, prefix: str = "", recurse: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        self._require_partitioned()
        for name, module in self.module.named_modules():
            if not self._is_local_module(module):
                continue
            for buffer_name, buffer in module.named_buffers(recurse=False):
                full = ".".join(part for part in (prefix, name, buffer_name) if part)
                yield full, buffer
            if not recurse:
                break

    def local_state_dict(self, cast_to_cpu: bool = True, destination: Any = None, prefix: str = "",
                         keep_vars: bool = False) -> dict[str, Any]:
        """The state of this partition: with one partition, the whole user module's; with several,
        the entries of the parameters and buffers this rank owns."""
        result = self._module_state_dict(destination, prefix, keep_vars, cast_to_cpu)
        if self._runner is not None:
            local = {prefix + k for k in self._local_keys()}
            for key in [k for k in result if k not in local]:
                del result[key]
        return result

    def state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False,
                   cast_to_cpu: bool = True, gather_to_rank0: bool = True) -> dict[str, Any]:
        """The user module's state dict (its keys, no wrapper prefix), on CPU unless ``cast_to_cpu=False``.

        Partitioned across ranks, every rank of the pipeline group must call it (a collective): each
        contributes the entries it owns, so the result holds the trained value of every entry.
        """
        result = self._module_state_dict(destination, prefix, keep_vars, cast_to_cpu)
        if self._runner is not None:
            local = {prefix + k for k in self._local_keys()}
            owned = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in result.items() if k in local}
            for part in comm.allgather(owned, comm.PP_GROUP):
                for key, value in part.items():
                    result[key] = value
        return result

    def _module_state_dict(self, destination: Any, prefix: str, keep_vars: bool, cast_to_cpu: bool) -> dict[str, Any]:
        result = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if cast_to_cpu:
            for name, value in result.items():
                if isinstance(value, torch.Tensor) and value.device.type != "cpu":
                    result[name] = value.cpu()
        return result

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load a state dict saved by ``state_dict()``/``local_state_dict()`` (or from the plain model).

        Partitioned, a full state dict or this rank's ``local_state_dict()`` loads: ``strict`` then
        asks for every entry of this rank's partition (entries of other partitions may be absent).
        """
        cleaned = {k: v for k, v in state_dict.items() if k not in _SMP_KEYS}
        if self._runner is None:
            return self.module.load_state_dict(cleaned, strict=strict, assign=assign)
        local, known = self._local_keys(), set(self.module.state_dict(keep_vars=True))
        cleaned = {k: v for k, v in cleaned.items() if k in local or k not in known}  # others' are released here
        result = self.module.load_state_dict(cleaned, strict=False, assign=assign)
        missing = sorted(set(result.missing_keys) & local)
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(f"Error(s) in loading state_dict for partition {self._runner.stage}: missing keys "
                               f"{missing}, unexpected keys {sorted(result.unexpected_keys)}")
        return result

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
