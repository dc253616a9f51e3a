"""Tensors that live anyway: parameters (trainable or frozen), their views, and module buffers.

Moving one of them frees nothing (the module keeps it) and copies it every layer, every step: the
``weight.t()`` a LoRA-frozen linear saves, the running statistics a frozen (eval-mode) BatchNorm
saves, a causal-mask or rotary buffer sliced into every layer. Parameters are recognised by type
(``nn.Parameter``) or as leaves that require grad. Buffers carry no mark, so while an offload session
lives a module forward pre-hook (``torch.nn.modules.module.register_module_forward_pre_hook``,
torch's global hook) notes the buffers of every module called (a region's boundary inputs are
sliced from buffers before its scope is entered, so noting only inside scopes would miss them); the
hook is removed when the last session is gone: a process that offloads nothing pays nothing.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_pre_hook


class _Buffers:
    """Buffers of the modules called while at least one offload scope is active."""

    PRUNE_AT = 1024

    def __init__(self) -> None:
        self.known: dict[int, weakref.ref[torch.Tensor]] = {}
        """id -> weak reference (not a WeakSet: comparing two weak references to a tensor compares
        the tensors elementwise)."""
        self.prune_at = self.PRUNE_AT
        self.users = 0
        self.handle: Any = None
        self.lock = threading.Lock()

    def note(self, module: torch.nn.Module, args: Any) -> None:
        known = self.known
        for buffer in module._buffers.values():
            if buffer is not None and buffer not in self:
                if len(known) >= self.prune_at:  # amortized: no Python code in weakref callbacks
                    for key in [key for key, ref in known.items() if ref() is None]:
                        del known[key]
                    self.prune_at = max(self.PRUNE_AT, 2 * len(known))
                known[id(buffer)] = weakref.ref(buffer)

    def __contains__(self, tensor: torch.Tensor) -> bool:
        ref = self.known.get(id(tensor))
        return ref is not None and ref() is tensor

    def enter(self) -> None:
        with self.lock:
            self.users += 1
            if self.handle is None:
                self.handle = register_module_forward_pre_hook(self.note)

    def exit(self) -> None:
        with self.lock:
            self.users -= 1
            if self.users == 0 and self.handle is not None:
                self.handle.remove()
                self.handle = None


BUFFERS = _Buffers()
"""Each offload session calls ``BUFFERS.enter()`` when made and ``exit()`` when gone."""


def lives_anyway(tensor: torch.Tensor) -> bool:
    """True if ``tensor`` is (a view of) a parameter, frozen or not, or of a noted module buffer."""
    base = tensor._base if tensor._base is not None else tensor
    if isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad):
        return True
    return not base.requires_grad and base in BUFFERS
