"""SMP v1 activation checkpointing: ``checkpoint``, ``checkpoint_sequential`` and
``set_activation_checkpointing`` (smdistributed.modelparallel.torch.patches.checkpoint and
``smp.set_activation_checkpointing``; SageMaker docs "Activation Checkpointing").

Every call becomes engine regions. Like SMP's own ``CheckpointTupledFunction`` the regions are
reentrant (recomputed inside an autograd Function), so ``torch.autograd.grad`` is refused as in
upstream; unlike torch's reentrant checkpoint they accept keyword arguments and nested inputs
(SMP v1.8.1+) and give parameters gradients even when no input requires grad.

With one partition (a single process) nothing can straddle a partition boundary, so the upstream
partition checks never fire and ``set_activation_checkpointing`` applies at once, in place, instead
of at the first ``smp.step`` (same object, same ``state_dict`` keys; idempotent).
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

from ..exceptions import CheckpointingConfigError, DistributedModelNotWrappedError, NotAModuleError
from ..state_mod import state

__all__ = ["checkpoint", "checkpoint_sequential", "set_activation_checkpointing"]


def region_options(preserve_rng_state: bool = True) -> RegionOptions:
    """Engine options for an SMP region: reentrant, RNG as asked, host offload when the config has it."""
    if not isinstance(preserve_rng_state, bool):
        raise TypeError(f"preserve_rng_state must be True or False, got {preserve_rng_state!r}")
    return RegionOptions(reentrant=True, preserve_rng_state=preserve_rng_state,
                         saved_tensors_scope=state.offload_scope())


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
    return run_region(module, args, kwargs, region_options(preserve_rng_state))


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
        checkpoint_sequential_groups(module, options, groups, bool(pack_args_as_tuple))
        return
    if strategy != "each":
        raise CheckpointingConfigError("strategy can only be used when checkpointing Sequential modules")
    if pack_args_as_tuple:
        raise CheckpointingConfigError(
            "pack_args_as_tuple can only be used when checkpointing Sequential modules: a "
            f"{type(module).__name__} receives its arguments unchanged; drop the argument")
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        warnings.warn(f"{type(module).__name__} is never called itself, so checkpointing it has no effect; "
                      "call smp.set_activation_checkpointing on each of its children", stacklevel=2)
    checkpoint_module(module, options)
