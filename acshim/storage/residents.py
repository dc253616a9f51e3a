"""Tensors that live anyway: parameters (trainable or frozen), their views, and module buffers.

Moving one of them frees nothing (the module keeps it) and copies it every layer, every step: the
``weight.t()`` a LoRA-frozen linear saves, the running statistics a frozen (eval-mode) BatchNorm
saves, a causal-mask or rotary buffer sliced into every layer. Parameters are recognised by type
(``nn.Parameter``) or as leaves that require grad. Buffers carry no mark, so inside an ``offload()``
block a module forward pre-hook (``torch.nn.modules.module.register_module_forward_pre_hook``,
torch's global hook) notes the buffers of every module called; the hook is removed when the last
block exits, so nothing is paid (and no global hook is seen) outside offloaded forwards. Noted
buffers stay known while they live, so a view of a buffer passed into a checkpointed region
(``boundary_offload``, whose scope starts after its parent sliced it) stays too once a forward
under ``offload()`` has called that parent; otherwise it is moved (it works, it only copies).
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
"""``offload()`` blocks call ``BUFFERS.enter()`` / ``exit()`` around their forwards (they nest)."""


def frozen_or_buffer(base: torch.Tensor) -> bool:
    """True if ``base`` (a tensor that is not a view) is a frozen parameter or a noted module
    buffer. Trainable parameters (leaves that require grad) are ``movable``'s own first check."""
    return isinstance(base, torch.nn.Parameter) or (not base.requires_grad and base in BUFFERS)
