"""Where offloaded activations go: the engine's storage tier (``acshim.storage``), resolved at call time.

Every facade spelling of offloading routes here: FairScale's ``checkpoint_wrapper(offload_to_cpu=True)``
and torch's pre-2.1 ``checkpoint_wrapper(offload_to_cpu=True)`` keep a region's boundary inputs on the
host (``boundary_offload``); torch's ``offload_wrapper`` sends every tensor saved inside its scope
to the engine's offload (``acshim.offload``). Until the storage tier exists both are null contexts,
which on a CPU-only machine is exactly where the tensors already live (host memory). Module-level
functions, not closures, so wrapped modules still pickle.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from types import ModuleType
from typing import Any


def _storage() -> ModuleType | None:
    if importlib.util.find_spec("acshim.storage") is None:
        return None
    return importlib.import_module("acshim.storage")


def storage_is_live() -> bool:
    """True when ``acshim.storage`` provides both offload entry points, so offloading really moves tensors."""
    storage = _storage()
    return storage is not None and hasattr(storage, "boundary_offload") and hasattr(storage, "offload")


def host_offload_scope() -> contextlib.AbstractContextManager[Any]:
    """A ``saved_tensors_hooks`` context keeping a region's boundary inputs in host memory."""
    storage = _storage()
    factory = getattr(storage, "boundary_offload", None) if storage is not None else None
    if factory is None:
        return contextlib.nullcontext()
    return factory(storage="host", prefetch=0)()


def offload_scope() -> contextlib.AbstractContextManager[Any]:
    """A context offloading every tensor autograd saves inside it, with the engine's defaults
    (prefetch horizon etc., e.g. as set by ``torch.sagemaker.init``)."""
    storage = _storage()
    offload = getattr(storage, "offload", None) if storage is not None else None
    if offload is None:
        return contextlib.nullcontext()
    return offload()
