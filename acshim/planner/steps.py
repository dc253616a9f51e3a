"""Where a training step starts, seen from outside the script: the outermost module call.

``acshim run --budget`` plans inside the script's first step, at its first checkpointed region; by
then the step's forward has begun. The budget is about memory above what the process held when the
step started (parameters, gradients, optimizer state: not activations), so that is the baseline the
planner's guard measures from. ``StepStart`` notes the process memory at every outermost module call
made with grad enabled (global forward hooks count the nesting depth), after giving the heap's free
memory back, as a measurement's baseline would (``process.trim``). It is removed once planning
starts: it costs a Python call per module call while it is installed.

The model's device is not known until planning finds the model, so the start is noted for the CPU
and for every CUDA device whose caching allocator has started (``held_now``); the session keeps the
model's (on a GPU, a CUDA baseline taken as the process's anonymous memory measured every step's
reserved bytes from the wrong origin: the H200's verified peaks differed from the steps' by -90 to
+250 MiB).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from .process import ProcessMemory, trim


def held_now(memory: ProcessMemory) -> dict[str, int]:
    """What the process holds now, after giving back what its allocators keep free (``trim``):
    ``memory``'s reading under ``"cpu"``, its file-backed pages under ``"file"``
    (``ProcessMemory.file_backed``), and the caching allocator's reserved bytes under
    ``"cuda:N"`` for every CUDA device it has started on (``device_key``)."""
    trim()
    held = {"cpu": memory.current(), "file": memory.file_backed()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for index in range(torch.cuda.device_count()):
            held[f"cuda:{index}"] = int(torch.cuda.memory_reserved(index))
    return held


def device_key(device: torch.device) -> str:
    """``held_now``'s key for ``device`` (a CUDA device without an index is the current one)."""
    if device.type != "cuda":
        return "cpu"
    return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"


class StepStart:
    """The process memory at the start of the latest outermost module call with grad enabled."""

    def __init__(self, memory: ProcessMemory) -> None:
        self.memory = memory
        self.held: dict[str, int] | None = None
        """``held_now`` at that call's start (None: no such call yet)."""
        self.depth = 0
        self._handles: list[Any] = []

    def start(self) -> StepStart:
        self._handles = [register_module_forward_pre_hook(self._enter),
                         register_module_forward_hook(self._leave, always_call=True)]
        return self

    def stop(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _enter(self, module: nn.Module, args: Any) -> None:
        if self.depth == 0 and torch.is_grad_enabled():
            self.held = held_now(self.memory)
        self.depth += 1

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self.depth = max(0, self.depth - 1)
