"""Keep BatchNorm running statistics updated once per step although a region runs twice.

A recompute runs the region's BatchNorm layers a second time in training mode, which would update
``running_mean``/``running_var``/``num_batches_tracked`` twice. While a region recomputes, a
global forward pre-hook snapshots each training-mode BatchNorm's statistics the first time it runs,
and the guard writes the snapshot back when the recompute ends (also when it stops early). The
recompute itself runs the same operators as the forward (switching ``track_running_stats`` off
would change what autograd saves and trip the determinism check). FairScale's ``patch_batchnorm``
skips the other pass instead; restoring after the recompute works for reentrant and non-reentrant
regions alike. The hook is registered only while some recompute runs.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack

try:
    from torch.utils.checkpoint import _CachedTorchDispatchMode
except ImportError:  # a torch without selective checkpointing: no such mode to step out of
    _CachedTorchDispatchMode = ()

_lock = threading.Lock()
_active_guards = 0
_hook_handle: Any = None
_local = threading.local()


_STATISTICS = ("running_mean", "running_var", "num_batches_tracked")


def _stashed() -> dict[_BatchNorm, list[tuple[torch.Tensor, torch.Tensor]]] | None:
    return getattr(_local, "stashed", None)


def _outside_selective_recompute() -> contextlib.AbstractContextManager[Any]:
    """The snapshot and write-back are acshim's own, not the region's: a selective region's recompute
    mode (``context_fn``) replays only the operators its forward ran and would reject them."""
    if any(isinstance(mode, _CachedTorchDispatchMode) for mode in _get_current_dispatch_mode_stack()):
        return _disable_current_modes()
    return contextlib.nullcontext()


def _pre_hook(module: torch.nn.Module, args: Any) -> None:
    stashed = _stashed()
    if stashed is None or not isinstance(module, _BatchNorm) or module in stashed:
        return
    if module.training and module.track_running_stats:
        buffers = [getattr(module, name) for name in _STATISTICS]
        with _outside_selective_recompute():
            stashed[module] = [(b, b.detach().clone()) for b in buffers if b is not None]


@contextlib.contextmanager
def running_stats_frozen() -> Iterator[None]:
    """Within the body, training-mode BatchNorm layers run on this thread do not update statistics."""
    global _active_guards, _hook_handle
    outer = _stashed()
    _local.stashed = {} if outer is None else outer
    with _lock:
        _active_guards += 1
        if _hook_handle is None:
            _hook_handle = torch.nn.modules.module.register_module_forward_pre_hook(_pre_hook)
    try:
        yield
    finally:
        if outer is None:
            with _outside_selective_recompute():
                for pairs in _local.stashed.values():
                    for buffer, snapshot in pairs:
                        # .data: write back without bumping the version counter autograd checks
                        buffer.data.copy_(snapshot)
            _local.stashed = None
        with _lock:
            _active_guards -= 1
            if _active_guards == 0 and _hook_handle is not None:
                _hook_handle.remove()
                _hook_handle = None
