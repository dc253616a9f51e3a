"""SMP v1 activation checkpointing: ``checkpoint``, ``checkpoint_sequential`` and
``set_activation_checkpointing`` (smdistributed.modelparallel.torch.patches.checkpoint and
``smp.set_activation_checkpointing``; SageMaker docs "Activation Checkpointing").

Every call becomes engine regions. Like SMP's own ``CheckpointTupledFunction`` the regions are
reentrant (recomputed inside an autograd Function), so ``torch.autograd.grad`` is refused as in
upstream; unlike torch's reentrant checkpoint they accept keyword arguments and nested inputs
(SMP v1.8.1+) and give parameters gradients even when no input requires grad.

With one partition nothing can straddle a partition boundary, so the upstream partition checks
never fire and ``set_activation_checkpointing`` applies at once, in place, instead of at the first
``smp.step`` (same object, same ``state_dict`` keys; idempotent).

With pipeline partitions across ranks (``pipeline_parallel_degree`` > 1 under a launcher) the
seed's rules hold: ``set_activation_checkpointing`` is recorded and applied when the model is
partitioned (first ``smp.step``); a checkpointed module must lie within one partition, and its
region runs on that partition's rank; an ``nn.Sequential`` may span partitions, each child (or
group of children) lying in one, and a group never crosses a boundary (``"contiguous"``: one group
per partition's run of children; ``group_N`` comes out shorter at a boundary). A module tree that
spans partitions is an error with manual partitioning and is run without checkpointing, with a
warning that it won't be checkpointed, with automatic partitioning.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from acshim.options import RegionOptions
from acshim.policy import strategy_groups
from acshim.region import run_region
from acshim.wrap import CheckpointedSequentialForward, checkpoint_module, checkpoint_sequential_groups

from .. import comm
from ..exceptions import CheckpointingConfigError, DistributedModelNotWrappedError, NotAModuleError
from ..state_mod import state

__all__ = ["checkpoint", "checkpoint_sequential", "set_activation_checkpointing"]


DIALECT = "smdistributed"
"""How ``acshim run --report`` names SMP v1's regions."""


def region_options(preserve_rng_state: bool = True) -> RegionOptions:
    """Engine options for an SMP region: reentrant, RNG as asked, host offload when the config has it."""
    if not isinstance(preserve_rng_state, bool):
        raise TypeError(f"preserve_rng_state must be True or False, got {preserve_rng_state!r}")
    return RegionOptions(reentrant=True, preserve_rng_state=preserve_rng_state,
                         saved_tensors_scope=state.offload_scope(), dialect=DIALECT)


def checkpoint(module: nn.Module, *args: Any, preserve_rng_state: bool = True, **kwargs: Any) -> Any:
    """Run ``module(*args, **kwargs)`` keeping only its inputs for backward; return its output.

    ``module`` must be a module INSTANCE (upstream: "a generic function cannot be passed").
    ``preserve_rng_state=False`` skips saving/restoring the RNG state (dropout masks then differ).
    """
    if not isinstance(module, nn.Module):
        raise NotAModuleError(
            f"{module!r} is not a Module: smp's checkpoint(module, *args) checkpoints an nn.Module instance "
            "and cannot take a plain function. Wrap the function in an nn.Module, or use "
            "torch.utils.checkpoint.checkpoint for arbitrary callables.")
    runner = _runner()
    if runner is not None:
        region_options(preserve_rng_state)  # validates the flag before any message is sent
        return runner.checkpoint(module, args, kwargs, preserve_rng_state)
    return run_region(module, args, kwargs, region_options(preserve_rng_state))


def _runner() -> Any:
    """The pipeline stage runner of the partitioned model, or None."""
    return getattr(state.model, "runner", None) if state.model is not None else None


def _require_sequential(sequential_module: Any) -> None:
    if not isinstance(sequential_module, nn.Sequential):
        raise NotAModuleError(
            "`checkpoint_sequential` can only be used with nn.Sequential modules. Passed module is of type "
            f"{type(sequential_module)}.")


def checkpoint_sequential(
    sequential_module: nn.Sequential,
    input: torch.Tensor | tuple[torch.Tensor, ...],
    strategy: str = "each",
    preserve_rng_state: bool = True,
    pack_args_as_tuple: bool = False,
) -> Any:
    """Run the children of ``sequential_module`` on ``input`` as checkpointed groups, this call only.

    ``strategy``: ``"each"`` (one region per child), ``"contiguous"`` (one region for all children:
    with one partition every child shares it) or ``"group_N"`` (N consecutive children per region,
    the last one shorter). Anything else raises ``ValueError``. ``pack_args_as_tuple=True``: ``input``
    is a tuple whose tensors enter the region separately (each gets a gradient) and each child is
    called with the packed tuple.
    """
    _require_sequential(sequential_module)
    groups = strategy_groups(strategy, len(sequential_module))
    runner = _runner()
    if runner is not None:
        region_options(preserve_rng_state)
        return runner.sequential(sequential_module, input, strategy, preserve_rng_state, bool(pack_args_as_tuple))
    run = CheckpointedSequentialForward(sequential_module, region_options(preserve_rng_state), groups,
                                        bool(pack_args_as_tuple))
    return run(input)


def set_activation_checkpointing(module: nn.Module, preserve_rng_state: bool = True,
                                 pack_args_as_tuple: bool = False, strategy: str = "each") -> None:
    """Checkpoint ``module`` (a submodule of the ``smp.DistributedModel``) without editing its forward.

    For an ``nn.Sequential`` the children are grouped by ``strategy`` (as ``checkpoint_sequential``);
    ``strategy`` other than ``"each"`` and ``pack_args_as_tuple=True`` are errors for any other module.
    """
    if state.model is None:
        raise DistributedModelNotWrappedError("set_activation_checkpointing can be called on a module")
    if not isinstance(module, nn.Module):
        raise CheckpointingConfigError("Only a module of type nn.Module can be passed for activation checkpointing")
    if not any(m is module for m in state.model.modules()):
        raise CheckpointingConfigError(
            f"set_activation_checkpointing got a {type(module).__name__} that is not part of the model wrapped by "
            "smp.DistributedModel; pass a submodule of model.get_module()")
    options = region_options(preserve_rng_state)
    if isinstance(module, nn.Sequential):
        groups = strategy_groups(strategy, len(module))
    else:
        if strategy != "each":
            raise CheckpointingConfigError("strategy can only be used when checkpointing Sequential modules")
        if pack_args_as_tuple:
            raise CheckpointingConfigError(
                "pack_args_as_tuple can only be used when checkpointing Sequential modules: a "
                f"{type(module).__name__} receives its arguments unchanged; drop the argument")
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            warnings.warn(f"{type(module).__name__} is never called itself, so checkpointing it has no effect; "
                          "call smp.set_activation_checkpointing on each of its children", stacklevel=2)
    mark = (module, preserve_rng_state, bool(pack_args_as_tuple), strategy)
    runner = _runner()
    if runner is not None:  # partitioned already: apply under the partition rules now
        apply_partitioned_checkpointing(runner, *mark)
        return
    if comm.pp_size() > 1:  # SMP applies it when the model is partitioned, at the first smp.step
        state.checkpoint_marks.append(mark)
        return
    if isinstance(module, nn.Sequential):
        checkpoint_sequential_groups(module, options, groups, bool(pack_args_as_tuple))
        return
    checkpoint_module(module, options)


def apply_partitioned_checkpointing(runner: Any, module: nn.Module, preserve_rng_state: bool,
                                    pack_args_as_tuple: bool, strategy: str) -> None:
    """Checkpoint ``module`` of a partitioned model under SMP v1's partition rules (module docstring)."""
    options = region_options(preserve_rng_state)
    in_one_partition = len(runner.stages_of(module)) == 1
    if isinstance(module, nn.Sequential):
        groups = strategy_groups(strategy, len(module))
        if in_one_partition:
            checkpoint_sequential_groups(module, options, groups, pack_args_as_tuple)
            return
        forward = runner.sequential_forward(module, strategy, preserve_rng_state, pack_args_as_tuple)
        if forward is not None:
            module.forward = forward
        return
    if not in_one_partition:
        runner.split_module(module, "set_activation_checkpointing")
        return
    checkpoint_module(module, options)
