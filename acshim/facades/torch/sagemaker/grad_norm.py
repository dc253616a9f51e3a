"""``torch.sagemaker.grad_norm``: gradient-norm clipping. SMP reduces the norm across its tensor- and
expert-parallel groups; in the native fallback there are none, so it is torch's ``clip_grad_norm_``
(FSDP1's own method for an FSDP1 model, whose parameters are shards; FSDP2's DTensors reduce themselves)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of ``model``'s parameters to ``max_norm``; returns the total norm before clipping."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"torch.sagemaker.grad_norm.clip_grad_norm_ takes the model, got {type(model).__name__}")
    for module in model.modules():  # the outermost FSDP1 unit knows its shards; plain clipping would not
        if isinstance(module, FullyShardedDataParallel):
            return module.clip_grad_norm_(max_norm, norm_type=norm_type)
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type=norm_type)


__all__ = ["clip_grad_norm_"]
