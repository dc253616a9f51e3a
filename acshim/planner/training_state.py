"""What a training loop holds for the model between its steps, counted from the tensors themselves:
the parameters' gradients and the state of the optimizers that step them.

The plan is solved inside the script's first step, when neither exists yet: torch's optimizers make
their state in their first ``step()`` (``Adam._init_group``: ``exp_avg``, ``exp_avg_sq``), and a
parameter's gradient is made by its first backward. A loop that keeps the gradients into the next
step (``zero_grad(set_to_none=False)``, gradient accumulation) or that steps an optimizer starts
every later step holding them, beside the activations, and the plan solved without them goes over
its budget from the second step on. Measured on one H200 (HF GPT-2 12 x 768, vocabulary 32000,
batch 4 x 512, ``zero_grad(set_to_none=False)``): at ``--budget 0.5`` (1.38 GiB) the first step
reserved 1442 MiB above its start and every later one 1842 MiB, the 405 MiB of gradients more.

Counting tensors (not the process's memory) makes the growth exact, free of the allocator's noise,
and the same on CPU and GPU. Optimizers are found by the step they take: torch's global
``register_optimizer_step_post_hook`` (``torch/optim/optimizer.py``) notes every optimizer that
steps while ``OptimizerWatch`` is installed.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook


@dataclass(frozen=True)
class TrainingState:
    """Bytes the model's training state holds now."""

    gradients: int = 0
    optimizer: int = 0

    @property
    def total(self) -> int:
        return self.gradients + self.optimizer

    def describe(self) -> str:
        parts = [f"{self.gradients / 2**20:.1f} MiB of gradients"] if self.gradients else []
        if self.optimizer:
            parts.append(f"{self.optimizer / 2**20:.1f} MiB of optimizer state")
        return " and ".join(parts) or "nothing"


class OptimizerWatch:
    """Notes every ``torch.optim.Optimizer`` that takes a step while installed (weakly: a script's
    optimizer is never kept alive by it)."""

    def __init__(self) -> None:
        self._seen: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._handle: Any = None

    def start(self) -> OptimizerWatch:
        if self._handle is None:
            self._handle = register_optimizer_step_post_hook(self._stepped)
        return self

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _stepped(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._seen.add(optimizer)

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return list(self._seen)


def training_state(model: nn.Module, watch: OptimizerWatch | None = None) -> TrainingState:
    """The bytes of ``model``'s parameters' gradients and of the state that the optimizers ``watch``
    saw step hold for those parameters, each storage counted once."""
    counted: set[tuple[str, int]] = set()

    def new_bytes(tensor: torch.Tensor) -> int:
        storage = tensor.untyped_storage()
        key = (str(tensor.device), storage.data_ptr())
        if key in counted or storage.nbytes() == 0:
            return 0
        counted.add(key)
        return storage.nbytes()

    parameters = list(model.parameters())
    counted.update((str(p.device), p.untyped_storage().data_ptr()) for p in parameters)  # weights are no state
    gradients = sum(new_bytes(p.grad) for p in parameters if p.grad is not None)
    owned = {id(p) for p in parameters}
    optimizer_bytes = 0
    for optimizer in watch.optimizers() if watch is not None else []:
        for parameter, state in list(optimizer.state.items()):
            if id(parameter) not in owned:
                continue
            for value in state.values():
                if isinstance(value, torch.Tensor) and not value.is_meta:
                    optimizer_bytes += new_bytes(value)
    return TrainingState(gradients, optimizer_bytes)
