"""What of a saved tensor moves: the bytes of the storage span it views, and how to rebuild it.

A saved tensor may be a strided view (a transpose, an expanded bias, a slice). Moving only its
storage span and rebuilding it with the same shape and strides (``as_strided``) gives back a tensor
that every kernel treats exactly as the original, so gradients stay bitwise equal; ``contiguous()``
would change the strides some kernels dispatch on.

A view that spans most of its storage (``WHOLE_STORAGE_FRACTION``) moves the whole storage instead,
so that its sibling views (q, k and v of one ``split``) find their bytes already moving and share
them: each storage byte moves once (``session``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .residents import frozen_or_buffer

WHOLE_STORAGE_FRACTION = 0.75
"""A view whose span covers at least this fraction of its storage moves the whole storage."""


@dataclass(frozen=True)
class Layout:
    """Shape, strides and dtype of a saved tensor, relative to its moved bytes."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    nbytes: int
    """Bytes moved (the span, or the whole storage)."""
    offset: int = 0
    """Storage offset, in elements, of the tensor within the moved bytes."""
    start: int = 0
    """Byte offset of the moved bytes within the tensor's storage."""


def span_elements(tensor: torch.Tensor) -> int:
    """Elements of storage from the tensor's first to its last addressed element."""
    if tensor.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))


def to_bytes(tensor: torch.Tensor) -> tuple[torch.Tensor, Layout]:
    """The bytes to move for ``tensor`` as a 1-D ``uint8`` tensor (a view, no copy) and its
    ``Layout``: its storage span, or its whole storage when the span covers most of it. Under
    torch.compile taken eagerly: a dtype-changing view out of a compiled graph cannot be replayed as
    an alias by AOTAutograd."""
    if torch.compiler.is_compiling():
        return _eager_to_bytes()(tensor)
    return _to_bytes(tensor)


@functools.cache
def _eager_to_bytes() -> Callable[[torch.Tensor], tuple[torch.Tensor, Layout]]:
    import torch._dynamo  # imported here: loaded already whenever something compiles, heavy otherwise

    return torch._dynamo.disable(_to_bytes)


def _to_bytes(tensor: torch.Tensor) -> tuple[torch.Tensor, Layout]:
    span = span_elements(tensor)
    offset = tensor.storage_offset()
    size = tensor.element_size()
    whole = 0 if torch.compiler.is_compiling() else tensor.untyped_storage().nbytes() // size  # fake storages
    if span < whole and span >= WHOLE_STORAGE_FRACTION * whole:
        flat = tensor.detach().as_strided((whole,), (1,), 0).view(torch.uint8)
        return flat, Layout(tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.device,
                            flat.numel(), offset, 0)
    flat = tensor.detach().as_strided((span,), (1,), offset).view(torch.uint8)
    return flat, Layout(tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.device, flat.numel(),
                        0, offset * size)


def view_layout(tensor: torch.Tensor, moved: Layout) -> Layout | None:
    """The layout of ``tensor`` within bytes already moved for another view of its storage
    (``moved``), or None if they do not hold all of it or cannot be viewed as its dtype."""
    size = tensor.element_size()
    start = tensor.storage_offset() * size
    end = start + span_elements(tensor) * size
    if start < moved.start or end > moved.start + moved.nbytes or (start - moved.start) % size:
        return None
    if moved.nbytes % size:
        return None
    return Layout(tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.device, moved.nbytes,
                  (start - moved.start) // size, moved.start)


def from_bytes(data: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Rebuild the saved tensor from its moved bytes (``data``: 1-D ``uint8``, same device)."""
    typed = data[:layout.nbytes].view(layout.dtype)
    if not layout.offset:  # (the same ops as ever: torch.compile's alias replay handles exactly these)
        return typed.as_strided(layout.shape, layout.stride)
    return typed.as_strided(layout.shape, layout.stride, typed.storage_offset() + layout.offset)


def nbytes(tensor: torch.Tensor) -> int:
    """Bytes of the tensor's own elements (the size floor compares against this)."""
    return tensor.numel() * tensor.element_size()


def movable(tensor: torch.Tensor, min_bytes: int) -> bool:
    """True if ``tensor`` may leave its device: a plain strided tensor of at least ``min_bytes`` that
    is not a parameter (trainable or frozen), a module buffer or a view of one (those live anyway;
    moving them would only duplicate them: ``residents``)."""
    if type(tensor) is not torch.Tensor or tensor.layout is not torch.strided:
        return False
    if tensor.device.type == "meta" or tensor.is_conj() or tensor.is_neg() or nbytes(tensor) < max(min_bytes, 1):
        return False
    base = tensor._base if tensor._base is not None else tensor
    if base.is_leaf and base.requires_grad:
        return False
    # While torch.compile traces the hooks, fake tensors answer neither check reliably: its graph
    # saves what its compiler chose, and parameters are told apart as above.
    return torch.compiler.is_compiling() or not frozen_or_buffer(base)
