"""``torch.sagemaker.grad_norm``: gradient-norm clipping. SMP reduces the norm across its tensor- and
expert-parallel groups; in the native fallback there are none, so it is torch's ``clip_grad_norm_``."""

from __future__ import annotations

import torch
from torch import nn


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of ``model``'s parameters to ``max_norm``; returns the total norm before clipping."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"torch.sagemaker.grad_norm.clip_grad_norm_ takes the model, got {type(model).__name__}")
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type=norm_type)


__all__ = ["clip_grad_norm_"]
