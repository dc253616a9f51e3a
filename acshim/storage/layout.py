"""What of a saved tensor moves: the bytes of the storage span it views, and how to rebuild it.

A saved tensor may be a strided view (a transpose, an expanded bias, a slice). Moving only its
storage span and rebuilding it with the same shape and strides (``as_strided``) gives back a tensor
that every kernel treats exactly as the original, so gradients stay bitwise equal; ``contiguous()``
would change the strides some kernels dispatch on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Layout:
    """Shape, strides and dtype of a saved tensor, relative to its moved byte span."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    nbytes: int
    """Bytes of the span (what is moved)."""


def span_elements(tensor: torch.Tensor) -> int:
    """Elements of storage from the tensor's first to its last addressed element."""
    if tensor.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))


def to_bytes(tensor: torch.Tensor) -> tuple[torch.Tensor, Layout]:
    """The tensor's storage span as a 1-D ``uint8`` tensor (a view, no copy) and its ``Layout``."""
    span = span_elements(tensor)
    flat = tensor.detach().as_strided((span,), (1,), tensor.storage_offset()).view(torch.uint8)
    return flat, Layout(tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.device, flat.numel())


def from_bytes(data: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Rebuild the saved tensor from its moved span (``data``: 1-D ``uint8``, same device)."""
    return data[:layout.nbytes].view(layout.dtype).as_strided(layout.shape, layout.stride)


def nbytes(tensor: torch.Tensor) -> int:
    """Bytes of the tensor's own elements (the size floor compares against this)."""
    return tensor.numel() * tensor.element_size()


def movable(tensor: torch.Tensor, min_bytes: int) -> bool:
    """True if ``tensor`` may leave its device: a plain strided tensor of at least ``min_bytes`` that
    is not a parameter or a view of one (those live anyway; moving them would only duplicate them)."""
    if type(tensor) is not torch.Tensor or tensor.layout is not torch.strided:
        return False
    if tensor.device.type == "meta" or tensor.is_conj() or tensor.is_neg() or nbytes(tensor) < max(min_bytes, 1):
        return False
    base = tensor._base if tensor._base is not None else tensor
    return not (base.is_leaf and base.requires_grad)
