"""``fairscale.nn.checkpoint.checkpoint_activations`` on the acshim engine.

Mirrors fairscale/nn/checkpoint/checkpoint_activations.py (0.4.13): ``checkpoint_wrapper`` patches
the module's ``forward`` in place (same object, same ``state_dict``), recomputes it reentrant-style
with RNG always preserved, accepts keyword arguments and non-tensor outputs, skips the recompute of
frozen modules (fairscale PR #787) and runs plainly with grad disabled or inside
``disable_checkpointing()``. The thread-local flags are the engine's (``acshim.state``), so
``is_recomputing()`` is True in every acshim region's recompute.

Deliberate differences (all "better"): outputs keep their structure (a list stays a list, dicts,
named tuples and dataclasses work; upstream returns a tuple and drops dict values); tensors nested
in containers get gradients; wrapped modules deep-copy and pickle (upstream's weakref partial
cannot, and its deep copy silently runs the original's parameters); BatchNorm statistics are kept
updated once by the engine instead of by ``patch_batchnorm``, also for frozen modules (upstream
never updates them there); ``.grad()`` raises torch's current reentrant error text.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from acshim import structures
from acshim.facades.torch.distributed.algorithms._checkpoint._storage import host_boundary_offload
from acshim.options import RegionOptions
from acshim.region import run_region
from acshim.state import (
    disable_checkpointing,
    enable_checkpointing,
    enable_recomputing,
    is_checkpointing,
    is_recomputing,
)
from acshim.state import state as thread_local
from acshim.wrap import CheckpointedForward

from .checkpoint_utils import patch_batchnorm

ThreadLocalCheckpointingState = type(thread_local)
"""The engine's per-thread state class (fields ``is_checkpointing``, ``is_recomputing``,
``is_checkpointing_disabled``), under FairScale's name."""


def _region_options(offload_to_cpu: Any) -> RegionOptions:
    return RegionOptions(reentrant=True, preserve_rng_state=True,
                         saved_tensors_scope=host_boundary_offload() if offload_to_cpu else None,
                         grad_error_message="Checkpointing is not compatible with .grad(), please use .backward() if "
                                            "possible",
                         dialect="fairscale")


def _needs_grad(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    parameters = list(module.parameters()) + list(getattr(module, "_unflattened_param_views", []))
    if any(p.requires_grad for p in parameters):
        return True
    leaves, _ = structures.flatten((args, kwargs))
    return any(isinstance(leaf, torch.Tensor) and leaf.requires_grad for leaf in leaves)


class FairScaleCheckpointedForward(CheckpointedForward):
    """The instance ``forward`` ``checkpoint_wrapper`` installs: the class ``forward`` (as upstream,
    never an earlier instance override) as one reentrant region. When neither the module's
    parameters nor any input tensor require grad the output could not require grad, so the forward
    runs once, plainly (still with ``is_checkpointing()`` True, as upstream), and nothing is recomputed."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        if torch.is_grad_enabled() and not thread_local.is_checkpointing_disabled and not _needs_grad(
                module, args, kwargs):
            with enable_checkpointing():
                return self.plain_forward()(*args, **kwargs)
        return run_region(self.plain_forward(), args, kwargs, self.options)

    def __deepcopy__(self, memo: dict[int, Any]) -> FairScaleCheckpointedForward:
        return FairScaleCheckpointedForward(copy.deepcopy(self.module, memo), self.options)

    def __reduce__(self) -> tuple[Any, ...]:
        return (FairScaleCheckpointedForward, (self.module, self.options))


def checkpoint_wrapper(module: nn.Module, offload_to_cpu: bool = False) -> nn.Module:
    """Make ``module`` recompute its activations in backward; returns the same module object.

    ``offload_to_cpu`` (truth-tested, as upstream): keep the region's saved inputs in host memory
    through the engine's storage tier (a no-op on CPU). Inner activations are not kept at all.

    >>> block = checkpoint_wrapper(block)
    >>> out, extra = block(x, y=3)
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"checkpoint_wrapper needs an nn.Module as `module`, got {type(module).__name__}")
    module.forward = FairScaleCheckpointedForward(module, _region_options(offload_to_cpu))
    return module


# --------------------------------------------------------------------------------------------------
# Upstream helpers kept under their names.


def get_rng_state() -> dict[str, Any]:
    """CPU RNG state, plus the current CUDA device's when CUDA is available (upstream's keys)."""
    state = {"torch_rng_state": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Install a state returned by ``get_rng_state``."""
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng_state"])


def is_autocast_enabled() -> bool:
    """``torch.is_autocast_enabled()`` (CUDA autocast), as upstream."""
    return torch.is_autocast_enabled()


@contextlib.contextmanager
def autocast(enabled: bool) -> Iterator[None]:
    """CUDA autocast when ``enabled``, else nothing (upstream's helper)."""
    if enabled:
        with torch.autocast("cuda"):
            yield
    else:
        yield


class CheckpointFunction:
    """FairScale's ``CheckpointFunction.apply`` calling convention on the engine's reentrant region.

    ``apply(dummy_tensor_requires_grad, run_function, parent_ctx_dict, kwarg_keys, *args)``: ``args``
    are the flat positional-then-keyword values (``fairscale.internal.containers.pack_kwargs``) with
    the module first. Sets ``parent_ctx_dict["output_requires_grad"]`` and, for non-tensor outputs,
    ``parent_ctx_dict["packed_non_tensor_outputs"]`` (``{"is_tensor": [...], "objects": [...]}``) and
    returns the tensors, exactly what upstream's caller expects. The dummy tensor is not needed (the
    engine gives parameters gradients without it) and is ignored.
    """

    @staticmethod
    def apply(dummy_tensor_requires_grad: torch.Tensor | None, run_function: Any, parent_ctx_dict: dict[str, Any],
              kwarg_keys: tuple[str, ...], *args: Any) -> Any:
        if len(kwarg_keys) > len(args):
            raise ValueError(f"too many keys {len(kwarg_keys)} vs. {len(args)}")
        split = len(args) - len(kwarg_keys)
        positional, kwargs = args[:split], dict(zip(kwarg_keys, args[split:]))
        module = positional[0] if positional and isinstance(positional[0], nn.Module) else None
        parameters = list(module.parameters()) + list(getattr(module, "_unflattened_param_views", [])) if module else []
        tensor_inputs = [a for a in args if isinstance(a, torch.Tensor)]
        parent_ctx_dict["output_requires_grad"] = any(p.requires_grad for p in parameters) or any(
            t.requires_grad for t in tensor_inputs)
        outputs = run_region(run_function, positional, kwargs, _region_options(parent_ctx_dict.get("offload")))
        if isinstance(outputs, torch.Tensor):
            return outputs
        is_tensor = [isinstance(o, torch.Tensor) for o in outputs]
        parent_ctx_dict["packed_non_tensor_outputs"] = {
            "is_tensor": is_tensor, "objects": [o for o, t in zip(outputs, is_tensor) if not t]}
        return tuple(o for o, t in zip(outputs, is_tensor) if t)


__all__ = [
    "CheckpointFunction", "ThreadLocalCheckpointingState", "autocast", "checkpoint_wrapper",
    "disable_checkpointing", "enable_checkpointing", "enable_recomputing", "get_rng_state", "is_autocast_enabled",
    "is_checkpointing", "is_recomputing", "patch_batchnorm", "set_rng_state", "thread_local",
]
