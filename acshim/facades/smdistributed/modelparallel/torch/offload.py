"""Route SMP v1's ``offload_activations`` / ``activation_loading_horizon`` to the engine's storage tier.

Upstream moves checkpointed activations of microbatches that are not running to host memory and
loads them back ``activation_loading_horizon`` tasks ahead of their backward. It only acts when
activation checkpointing is on AND ``microbatches > 1`` (with one microbatch it saves nothing);
acshim mirrors that: the scope below is attached only to checkpointed regions, and only when the
config has more than one microbatch. The storage tier (``acshim.storage.boundary_offload``) is
imported lazily; while it is absent the keys are accepted and validated and ``offload_status``
says so.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from .config import SMPConfig

_warned: set[str] = set()


def _boundary_offload() -> Callable[..., AbstractContextManager[Any]] | None:
    try:
        from acshim import storage
    except ImportError:
        return None
    return getattr(storage, "boundary_offload", None)


def offload_status(cfg: SMPConfig) -> str:
    """``"off"``, ``"inactive: ..."`` (requested but upstream would not offload either),
    ``"unavailable: ..."`` (engine tier missing) or ``"live"``."""
    if not cfg.offload_activations:
        return "off"
    if cfg.microbatches <= 1:
        return "inactive: offload_activations needs microbatches > 1 (as in SMP)"
    if _boundary_offload() is None:
        return "unavailable: acshim.storage.boundary_offload is not installed"
    return "live"


def saved_tensors_scope(cfg: SMPConfig) -> Callable[[], AbstractContextManager[Any]] | None:
    """The saved-tensors scope factory checkpointed regions use (``boundary_offload(storage="host",
    prefetch=activation_loading_horizon)``), or None when nothing is offloaded."""
    status = offload_status(cfg)
    if status != "live":
        if status.startswith("unavailable") and status not in _warned:
            _warned.add(status)
            warnings.warn(f"smp offload_activations=True is accepted but not applied: {status}", stacklevel=3)
        return None
    factory = _boundary_offload()
    assert factory is not None  # offload_status returned "live"
    return factory(storage="host", prefetch=cfg.activation_loading_horizon)

__all__ = []
