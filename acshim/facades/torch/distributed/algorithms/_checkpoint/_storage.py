"""Where offloaded activations go: the engine's storage tier (``acshim.storage``), looked up when used.

Every facade spelling of offloading routes here: FairScale's ``checkpoint_wrapper(offload_to_cpu=True)``
and torch's pre-2.1 ``checkpoint_wrapper(offload_to_cpu=True)`` keep a region's boundary inputs on the
host (``acshim.storage.boundary_offload``); torch's ``offload_wrapper`` sends every tensor saved inside
its scope to ``acshim.storage.offload`` with the engine's defaults (storage tier, prefetch horizon:
what ``torch.sagemaker.init`` configures). While the storage tier is absent, nothing moves, which on
a CPU-only machine is where the tensors belong anyway (host memory); on CPU the host tier keeps CPU
tensors in place by design, never copying them.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from collections.abc import Callable
from typing import Any


def _storage_entry(name: str) -> Any:
    if importlib.util.find_spec("acshim.storage") is None:
        return None
    return getattr(importlib.import_module("acshim.storage"), name, None)


def storage_is_live() -> bool:
    """True when ``acshim.storage`` provides ``offload`` and ``boundary_offload``: offloading is real."""
    return _storage_entry("offload") is not None and _storage_entry("boundary_offload") is not None


def host_boundary_offload() -> Callable[[], contextlib.AbstractContextManager[Any]] | None:
    """A ``RegionOptions.saved_tensors_scope`` that keeps a region's boundary inputs in host memory,
    or None while the storage tier is absent. One per wrapped module: each call of the module is one
    group, sent out and brought back on its own (horizon 0), as FairScale moves inputs back in backward."""
    factory = _storage_entry("boundary_offload")
    return None if factory is None else factory(storage="host", prefetch=0)


def offload_scope() -> contextlib.AbstractContextManager[Any]:
    """A context offloading every tensor autograd saves inside it (engine defaults), or a null context."""
    offload = _storage_entry("offload")
    return contextlib.nullcontext() if offload is None else offload()
