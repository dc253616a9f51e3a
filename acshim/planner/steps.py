"""Where a training step starts, seen from outside the script: the outermost module call.

``acshim run --budget`` plans inside the script's first step, at its first checkpointed region; by
then the step's forward has begun. The budget is about memory above what the process held when the
step started (parameters, gradients, optimizer state: not activations), so that is the baseline the
planner's guard measures from. ``StepStart`` notes the process memory at every outermost module call
made with grad enabled (global forward hooks count the nesting depth), after giving the heap's free
memory back, as a measurement's baseline would (``process.trim``). It is removed once planning
starts: it costs a Python call per module call while it is installed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from .process import ProcessMemory, trim


class StepStart:
    """The process memory at the start of the latest outermost module call with grad enabled."""

    def __init__(self, memory: ProcessMemory) -> None:
        self.memory = memory
        self.baseline: int | None = None
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
            trim()
            self.baseline = self.memory.current()
        self.depth += 1

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self.depth = max(0, self.depth - 1)
