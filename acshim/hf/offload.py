"""Route transformers' ``offload=True`` and Accelerate's ``activation_checkpointing_offload`` to
the engine's storage tier.

Upstream wraps every checkpoint call in ``save_on_cpu(pin_memory=True)`` (transformers 5.x) or
torch's ``offload_wrapper`` (Accelerate FSDP2); on a CPU-only machine the first fails outright
(pinned memory needs an accelerator) and the second copies CPU tensors to the CPU. acshim asks the
storage tier (``acshim.storage.boundary_offload``) for a ``saved_tensors_scope`` that moves each
region's boundary inputs off the device; that tier does nothing for tensors already on the host.
Until the storage tier is installed the flag is accepted and nothing moves (never an error).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from ..options import RegionOptions

ScopeFactory = Callable[[], AbstractContextManager[Any]]


def boundary_offload_scope() -> ScopeFactory | None:
    """The storage tier's boundary-offload scope factory, or None when ``acshim.storage`` (or its
    ``boundary_offload``) is not available."""
    try:
        storage = importlib.import_module("acshim.storage")
    except ImportError:
        return None
    boundary_offload = getattr(storage, "boundary_offload", None)
    if boundary_offload is None:
        return None
    made = boundary_offload()
    # ``boundary_offload(...)`` returns the factory; tolerate it being the factory itself.
    if hasattr(made, "__enter__"):
        return boundary_offload
    return made


def with_offload(options: RegionOptions, offload: bool) -> RegionOptions:
    """``options`` with the boundary-offload scope when ``offload`` is set (and none given yet)."""
    if not offload or options.saved_tensors_scope is not None:
        return options
    scope = boundary_offload_scope()
    return options.replace(saved_tensors_scope=scope) if scope is not None else options
