"""The one state object behind DeepSpeed's activation-checkpointing module globals.

Upstream (deepspeed/runtime/activation_checkpointing/checkpointing.py) keeps its configuration in
module globals that callers read and assign (``checkpointing.PARTITION_ACTIVATIONS = True``;
DeepSpeed's own tests snapshot and restore them with ``setattr``). The facade keeps them in one
``CheckpointingState`` and makes the module's class a ``ModuleType`` subclass whose properties read
and write that object, so both spellings stay live and tests can ``reset()`` everything at once.

When the real DeepSpeed is installed and its entry points are patched, a patched call runs inside
``STATE.bound_to(real_module_globals)``: the configuration names are then read from and written to
the real module's globals, so scripts that read or assign them on the real module see one state.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import Any

_DEFAULTS: dict[str, Callable[[], Any]] = {
    "deepspeed_checkpointing_enabled": lambda: False,
    "mpu": lambda: None,
    "mp_rank": lambda: 0,
    "mp_size": lambda: 1,
    "mp_group": lambda: None,
    "num_layers": lambda: None,
    "contiguous_data_buffers": list,
    "data_offsets": list,
    "contiguous_size_buffers": list,
    "size_offsets": list,
    "PARTITION_ACTIVATIONS": lambda: False,
    "CPU_CHECKPOINT": lambda: False,
    "CONTIGUOUS_CHECKPOINTING": lambda: False,
    "SYNCHRONIZE": lambda: False,
    "PROFILE_TIME": lambda: False,
    "_cpu_offload_engine": lambda: None,
    "_checkpoint_grad_enabled": lambda: True,
    "timers": lambda: None,
    "_CUDA_RNG_STATE_TRACKER": lambda: None,  # set by the checkpointing module at import
}
"""Every upstream module global the state holds, with its import-time value."""

LOCAL_ONLY = frozenset({"timers", "_CUDA_RNG_STATE_TRACKER", "_cpu_offload_engine"})
"""Names that always stay in the facade's own store: the real module's objects under these names
are upstream classes (its tracker, timers, offload engine) the engine cannot use."""

GLOBAL_NAMES = tuple(_DEFAULTS)


class CheckpointingState:
    """Upstream's module globals as one object (attribute names are the upstream global names)."""

    def __init__(self) -> None:
        object.__setattr__(self, "_own", {name: make() for name, make in _DEFAULTS.items()})
        object.__setattr__(self, "_bound", None)

    def _store_for(self, name: str) -> dict[str, Any]:
        bound = self._bound
        return bound if bound is not None and name not in LOCAL_ONLY else self._own

    def __getattr__(self, name: str) -> Any:
        if name not in _DEFAULTS:
            raise AttributeError(f"DeepSpeed checkpointing state has no global {name!r}")
        return self._store_for(name)[name]

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in _DEFAULTS:
            raise AttributeError(f"DeepSpeed checkpointing state has no global {name!r}")
        self._store_for(name)[name] = value

    def reset(self, keep: tuple[str, ...] = ("_CUDA_RNG_STATE_TRACKER",)) -> None:
        """Put every global back to its import-time value (``keep``: names left as they are)."""
        for name, make in _DEFAULTS.items():
            if name not in keep:
                self._own[name] = make()

    def snapshot(self) -> dict[str, Any]:
        """The current value of every global (for tests that restore state afterwards)."""
        return {name: getattr(self, name) for name in GLOBAL_NAMES}

    @contextlib.contextmanager
    def bound_to(self, namespace: dict[str, Any] | None) -> Iterator[None]:
        """Within the body, configuration names live in ``namespace`` (a real module's globals).

        Names the namespace lacks (older upstream versions) are added with their defaults. Nested
        use with the same namespace is a no-op.
        """
        previous = self._bound
        if namespace is None or namespace is previous:
            yield
            return
        for name, make in _DEFAULTS.items():
            if name not in LOCAL_ONLY:
                namespace.setdefault(name, make())
        object.__setattr__(self, "_bound", namespace)
        try:
            yield
        finally:
            object.__setattr__(self, "_bound", previous)


STATE = CheckpointingState()


def _global_property(name: str) -> property:
    def read(module: types.ModuleType) -> Any:
        return getattr(STATE, name)

    def write(module: types.ModuleType, value: Any) -> None:
        setattr(STATE, name, value)

    return property(read, write, doc=f"upstream module global ``{name}`` (lives in ``STATE``)")


class StateBackedModule(types.ModuleType):
    """A module whose upstream global names are properties over ``STATE``: reads and assignments
    (``module.PARTITION_ACTIVATIONS = True``, ``setattr``) go to the one state object."""

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *GLOBAL_NAMES})


for _name in GLOBAL_NAMES:
    setattr(StateBackedModule, _name, _global_property(_name))
del _name
