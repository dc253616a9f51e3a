"""``fairscale.nn.checkpoint.checkpoint_utils.patch_batchnorm``.

Mirrors upstream: every ``_BatchNorm`` submodule without a ``disable_patch_batchnorm`` attribute
gets a forward pre-hook and a forward hook; while grad is disabled the pre-hook switches
``track_running_stats`` off (backing it up in ``_track_running_stats_backup``) and the hook restores
it, so a no-grad forward in training mode leaves the running statistics alone. Returns the handles.

Deliberate difference: inside an acshim region's first forward (``is_checkpointing()``) the hooks
do nothing. The engine already keeps statistics updated once per step (it restores them after the
recompute, ``acshim.region_buffers``); skipping them in the forward as well would mean they were never
updated.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.hooks import RemovableHandle

from acshim.state import is_checkpointing


def _acts(module: _BatchNorm) -> bool:
    return not torch.is_grad_enabled() and not is_checkpointing()


def _pre_forward(module: _BatchNorm, args: Any) -> None:
    if _acts(module):
        module._track_running_stats_backup = module.track_running_stats
        module.track_running_stats = False


def _post_forward(module: _BatchNorm, args: Any, output: Any) -> None:
    if _acts(module) and hasattr(module, "_track_running_stats_backup"):
        module.track_running_stats = module._track_running_stats_backup


def patch_batchnorm(module: nn.Module) -> list[RemovableHandle]:
    """Stop the BatchNorm layers in ``module`` from updating running statistics in no-grad
    forwards; returns the hook handles (pre, post per layer) so the caller can remove them."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"patch_batchnorm needs an nn.Module, got {type(module).__name__}")
    handles: list[RemovableHandle] = []
    for child in module.modules():
        if isinstance(child, _BatchNorm) and not hasattr(child, "disable_patch_batchnorm"):
            handles.append(child.register_forward_pre_hook(_pre_forward))
            handles.append(child.register_forward_hook(_post_forward))
    return handles


__all__ = ["patch_batchnorm"]
