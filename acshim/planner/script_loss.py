"""What the script's own loss needs beyond the planner's: measured once, on the planning step.

The planner plans and verifies a step as the model's forward plus its own planning loss
(``head.planning_loss``: a sum, whose backward allocates nothing). A script that computes its loss
outside the model's forward (``model(x).square().mean()``, cross-entropy on returned logits) holds
output-sized temporaries and their gradients between the model's forward end and the moment its
backward reaches the model's output, which the plan never charged (README's train.py went 1.07x
over its least budget by ``VmHWM``). ``ScriptLossWindow`` watches that window on the interrupted
planning step, which the script continues after the plan is made: a forward hook on the model notes
the process's memory when its forward ends, a recording dispatch mode samples the process after
every operator (as ``process.Guard`` does, without a limit), and a gradient hook on the model's
outputs closes the window. Nothing is computed differently; the mode leaves the stack at the next
step's start (a backward restores the thread's dispatch modes as they were when it began), and is
not pushed where the script has a dispatch mode of its own on the stack (then nothing is charged).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode,
    _get_current_dispatch_mode_stack,
)

from .. import structures
from .process import ProcessMemory


class _Sampler(TorchDispatchMode):
    """Samples the process's memory after every operator while ``active``; passes through after."""

    def __init__(self, memory: ProcessMemory) -> None:
        super().__init__()
        self.memory = memory
        self.active = True
        self.peak = memory.current()

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.active:
            self.peak = max(self.peak, self.memory.current())
        return out


class ScriptLossWindow:
    """The most the process holds, above what it held at the model's forward end, until the script's
    backward reaches the model's output (``needed``; None until measured). See the module docstring."""

    def __init__(self, root: nn.Module, memory: ProcessMemory) -> None:
        self.memory = memory
        self.needed: int | None = None
        self._start = 0
        self._sampler: _Sampler | None = None
        self._handle = root.register_forward_hook(self._forward_ended)

    def _forward_ended(self, module: nn.Module, args: Any, output: Any) -> None:
        self._handle.remove()
        if not torch.is_grad_enabled() or not module.training:
            return
        outputs = [leaf for leaf in structures.flatten(output)[0]
                   if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
        if not outputs or not self.memory.available or _get_current_dispatch_mode_stack():
            return  # another mode on the stack (the script's own) might be popped above the sampler
        self._start = self.memory.current()
        self._sampler = _Sampler(self.memory)
        self._sampler.__enter__()
        for leaf in outputs:
            leaf.register_hook(self._reached)

    def _reached(self, grad: torch.Tensor) -> None:
        sampler = self._sampler
        if sampler is None or not sampler.active:
            return
        sampler.active = False
        self.needed = max(0, max(sampler.peak, self.memory.current()) - self._start)

    def close(self) -> int | None:
        """Take the sampler off the dispatch stack (where it is still on top) and return ``needed``."""
        self._handle.remove()
        sampler, self._sampler = self._sampler, None
        if sampler is not None:
            sampler.active = False
            if _get_current_dispatch_mode() is sampler:
                sampler.__exit__(None, None, None)
        return self.needed
