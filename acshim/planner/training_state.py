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

The first plan is solved before any optimizer has stepped, so the state a first ``step()`` will make
is foreseen (``foreseen_optimizer_state``): the process's optimizers are found among the objects the
garbage collector tracks, and for every parameter of the model they hold without state yet, the
parameter-shaped tensors their class makes in ``_init_group`` (``STATE_PER_PARAMETER``) are charged
to the first plan. An optimizer class not in that table is foreseen to make nothing; its state is
charged when the step after its first ``step()`` starts (``PlanSession._charge_training_state``).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
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
    foreseen: int = 0
    """Optimizer state not made yet, that the optimizers' first ``step()`` makes (charged ahead)."""

    @property
    def total(self) -> int:
        return self.gradients + self.optimizer + self.foreseen

    def describe(self) -> str:
        parts = [f"{self.gradients / 2**20:.1f} MiB of gradients"] if self.gradients else []
        if self.optimizer:
            parts.append(f"{self.optimizer / 2**20:.1f} MiB of optimizer state")
        if self.foreseen:
            parts.append(f"{self.foreseen / 2**20:.1f} MiB of optimizer state foreseen")
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

    def adopt(self, optimizer: torch.optim.Optimizer) -> None:
        """Note ``optimizer`` before it steps (one found holding the model's parameters)."""
        self._seen.add(optimizer)

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return list(self._seen)


def _loop_parameters(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """``model``'s parameters, then every other parameter an optimizer among ``optimizers`` that steps
    one of them holds (a second model trained beside it: its gradients and state are the loop's too,
    held across the model's steps; a two-model script whose second model's were left out went 2.2%
    over its budget from its second step on)."""
    parameters = list(model.parameters())
    owned = {id(p) for p in parameters}
    for optimizer in optimizers:
        held = [p for group in optimizer.param_groups for p in group.get("params", ())]
        if any(id(p) in owned for p in held):
            for parameter in held:
                if id(parameter) not in owned:
                    owned.add(id(parameter))
                    parameters.append(parameter)
    return parameters


def training_state(model: nn.Module, watch: OptimizerWatch | None = None) -> TrainingState:
    """The bytes of the gradients and of the optimizer state (of the optimizers ``watch`` saw) of
    ``model``'s parameters and of every parameter an optimizer stepping them holds besides
    (``_loop_parameters``), each storage counted once."""
    counted: set[tuple[str, int]] = set()

    def new_bytes(tensor: torch.Tensor) -> int:
        storage = tensor.untyped_storage()
        key = (str(tensor.device), storage.data_ptr())
        if key in counted or storage.nbytes() == 0:
            return 0
        counted.add(key)
        return storage.nbytes()

    optimizers = watch.optimizers() if watch is not None else []
    parameters = _loop_parameters(model, optimizers)
    counted.update((str(p.device), p.untyped_storage().data_ptr()) for p in parameters)  # weights are no state
    gradients = sum(new_bytes(p.grad) for p in parameters if p.grad is not None)
    owned = {id(p) for p in parameters}
    optimizer_bytes = 0
    for optimizer in optimizers:
        for parameter, state in list(optimizer.state.items()):
            if id(parameter) not in owned:
                continue
            for value in state.values():
                if isinstance(value, torch.Tensor) and not value.is_meta:
                    optimizer_bytes += new_bytes(value)
    return TrainingState(gradients, optimizer_bytes)


def _adam(group: dict[str, Any]) -> int:
    return 3 if group.get("amsgrad") else 2


STATE_PER_PARAMETER: dict[str, Callable[[dict[str, Any]], int]] = {
    # torch/optim/<name>.py, ``_init_group``: the parameter-shaped tensors a first step makes
    "Adam": _adam,  # exp_avg, exp_avg_sq (and max_exp_avg_sq with amsgrad); AdamW subclasses Adam
    "AdamW": _adam,
    "Adamax": lambda group: 2,  # exp_avg, exp_inf
    "NAdam": lambda group: 2,  # exp_avg, exp_avg_sq
    "RAdam": lambda group: 2,  # exp_avg, exp_avg_sq
    "Adadelta": lambda group: 2,  # square_avg, acc_delta
    "Rprop": lambda group: 2,  # prev, step_size
    "ASGD": lambda group: 1,  # ax
    "RMSprop": lambda group: 1 + bool(group.get("momentum")) + bool(group.get("centered")),
    "SGD": lambda group: 1 if group.get("momentum") else 0,  # momentum_buffer
    "Adagrad": lambda group: 0,  # its sum is made in __init__: held already
}
"""Parameter-shaped state tensors per parameter that each torch optimizer's first step makes, from
its parameter group (the 0-dim ``step`` counters are left out)."""


def foreseen_optimizer_state(model: nn.Module, watch: OptimizerWatch | None = None) -> int:
    """Bytes of state the process's optimizers that hold ``model``'s parameters will make at their
    first ``step()``: for each parameter such an optimizer of a class in ``STATE_PER_PARAMETER`` (or
    a subclass) holds (the model's, and a second model's it steps too) and keeps no state for yet,
    that many tensors of the parameter's size. Optimizers are found by one pass over the objects the
    garbage collector tracks (written by hand: torch keeps no registry of optimizers, and its step
    hooks only run once one has stepped); ``watch`` adopts them, so that the gradients of the
    parameters they hold count before they step."""
    owned = {id(p): p for p in model.parameters()}
    if not owned:
        return 0
    total = 0
    counted: set[int] = set()
    for candidate in gc.get_objects():
        if not issubclass(type(candidate), torch.optim.Optimizer):  # type(): isinstance reads __class__, which
            continue  # some module proxies answer with a deprecation warning
        held = [p for group in candidate.param_groups for p in group.get("params", ())]
        if not any(id(p) in owned for p in held):
            continue
        if watch is not None:
            watch.adopt(candidate)
        tensors = next((STATE_PER_PARAMETER[k.__name__] for k in type(candidate).__mro__
                        if k.__name__ in STATE_PER_PARAMETER and k.__module__.startswith("torch.optim")), None)
        if tensors is None:
            continue
        for group in candidate.param_groups:
            per_parameter = tensors(group)
            for parameter in group.get("params", ()):
                if id(parameter) in counted or candidate.state.get(parameter) or not parameter.requires_grad:
                    continue
                counted.add(id(parameter))
                total += per_parameter * parameter.numel() * parameter.element_size()
    return total
