"""``smp.nn``: ``FusedLayerNorm`` as ``torch.nn.LayerNorm`` (same maths, no fused kernel). SMP's
tensor-parallel modules (``DistributedTransformer``, ``DistributedLinear``...) need model
parallelism across processes and raise ``NotImplementedError`` when touched."""

from __future__ import annotations

from typing import Any

from torch import nn


class FusedLayerNorm(nn.LayerNorm):
    """``apex``-style fused layer norm, computed by ``torch.nn.LayerNorm``."""


def __getattr__(name: str) -> Any:
    if name.startswith("Distributed"):
        raise NotImplementedError(
            f"smp.nn.{name} is a tensor-parallel module of SMP v1; acshim's single-process facade does not "
            "provide tensor parallelism. Use the plain PyTorch / Hugging Face module instead.")
    raise AttributeError(f"module 'smp.nn' has no attribute {name!r}")


__all__ = ["FusedLayerNorm"]
