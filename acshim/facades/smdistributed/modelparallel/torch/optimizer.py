"""``smp.DistributedOptimizer`` (smdistributed.modelparallel.torch.optimizers.optimizer).

Delegates to the wrapped optimizer: in one partition its state is already the whole state. With
pipeline partitions across ranks, the wrapped optimizer keeps only this rank's parameters once the
model is partitioned (so ``step`` updates those alone); ``local_state_dict`` is that optimizer's
state, and ``state_dict`` gathers every stage's (a collective over the pipeline group) as
``{"_smp_pipeline_states": [stage 0's, stage 1's, ...]}``, which ``load_state_dict`` splits again. It is a
``torch.optim.Optimizer`` (without running that ``__init__``) so LR schedulers accept it, as they
accept upstream's. Loss scaling arguments are accepted; they only matter with ``fp16``, which the
single-process facade does not model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import comm
from .state_mod import state

PIPELINE_STATES = "_smp_pipeline_states"


class DistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, optimizer: torch.optim.Optimizer, static_loss_scale: float = 1.0,
                 dynamic_loss_scale: bool = False, **dynamic_loss_args: Any) -> None:
        # Not calling Optimizer.__init__: this object only forwards to ``optimizer``.
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"smp.DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.__dict__["optimizer"] = optimizer
        self.static_loss_scale = static_loss_scale
        self.dynamic_loss_scale = dynamic_loss_scale
        self.dynamic_loss_args = dynamic_loss_args
        state.optimizer = self
        if getattr(state.model, "runner", None) is not None:
            self._keep_local_parameters(state.model)

    def _keep_local_parameters(self, model: Any) -> None:
        """Drop other partitions' parameters from the wrapped optimizer's groups."""
        for group in self.optimizer.param_groups:
            group["params"] = [p for p in group["params"] if model._is_local_parameter(p)]

    # attributes schedulers and scripts read or assign live on the wrapped optimizer
    param_groups = property(lambda self: self.optimizer.param_groups,
                            lambda self, value: setattr(self.optimizer, "param_groups", value))
    state = property(lambda self: self.optimizer.state, lambda self, value: setattr(self.optimizer, "state", value))
    defaults = property(lambda self: self.optimizer.defaults,
                        lambda self, value: setattr(self.optimizer, "defaults", value))

    def __getattr__(self, name: str) -> Any:
        optimizer = self.__dict__.get("optimizer")
        if optimizer is None:
            raise AttributeError(name)
        return getattr(optimizer, name)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        return self.optimizer.step(closure) if closure is not None else self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        """The whole state: the wrapped optimizer's, or every pipeline stage's when partitioned."""
        if getattr(state.model, "runner", None) is None:
            return self.optimizer.state_dict()
        return {PIPELINE_STATES: comm.allgather(self.optimizer.state_dict(), comm.PP_GROUP)}

    def local_state_dict(self) -> dict[str, Any]:
        """The state of this partition: with one partition, the whole optimizer state."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ``state_dict()`` or ``local_state_dict()`` output (this stage's part of a gathered one)."""
        if PIPELINE_STATES in state_dict:
            state_dict = state_dict[PIPELINE_STATES][comm.pp_rank()]
        self.optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r})"

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, value: dict[str, Any]) -> None:
        self.__dict__.update(value)

__all__ = ["DistributedOptimizer"]
