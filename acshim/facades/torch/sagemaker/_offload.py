"""Route SMP v2's ``sm_activation_offloading`` / ``activation_loading_horizon`` to the engine's storage defaults.

SMP v2 offloads only where the script applies ``offload_wrapper`` to the root module (with
activation checkpointing); its own implementation (``sm_activation_offloading=True``) differs from
native PyTorch offloading by prefetching the offloaded activations ``activation_loading_horizon``
layers ahead of backward. So the flags map to one engine default: the prefetch horizon of
offloaded activations (the horizon when True, 0 = no prefetch, as native, when False). The
``offload_wrapper`` facade reads the engine defaults. ``acshim.storage`` is imported lazily; while
it lacks ``set_defaults`` the config is accepted and validated and ``offload_status`` says so.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from typing import Any


def _set_defaults() -> Any:
    if importlib.util.find_spec("acshim.storage") is None:
        return None
    return getattr(importlib.import_module("acshim.storage"), "set_defaults", None)


def engine_defaults(sm_activation_offloading: bool, activation_loading_horizon: int) -> dict[str, Any]:
    """The engine storage defaults this config stands for."""
    return {"prefetch": activation_loading_horizon if sm_activation_offloading else 0}


def route(sm_activation_offloading: bool, activation_loading_horizon: int) -> str:
    """Apply the defaults to the engine; returns ``"live"`` or ``"unavailable: ..."``."""
    set_defaults = _set_defaults()
    if set_defaults is None:
        return "unavailable: acshim.storage.set_defaults is not installed"
    defaults = engine_defaults(sm_activation_offloading, activation_loading_horizon)
    accepted = inspect.signature(set_defaults).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in accepted.values()):
        defaults = {k: v for k, v in defaults.items() if k in accepted}
    if not defaults:
        return "unavailable: acshim.storage.set_defaults takes no prefetch horizon"
    set_defaults(**defaults)
    return "live"
