"""The one SMP v1 process state object (upstream: ``smdistributed.modelparallel.torch.state_mod.state``).

Holds the validated config, the wrapped model and optimizer, and whether an ``smp.step`` body is
running. Tests reset it with ``state.reset()``; nothing else is module-level mutable state.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from . import offload
from .config import SMPConfig, parse_config
from .exceptions import NotInitializedError


@dataclass
class SMPState:
    cfg: SMPConfig | None = None
    model: Any = None
    optimizer: Any = None
    in_step_func: bool = False
    microbatch: int = 0
    post_partition_hooks: OrderedDict[int, Any] = field(default_factory=OrderedDict)  # weakref-able
    # manual pipeline placement: module -> partition (smp.partition / smp.set_partition)
    placements: weakref.WeakKeyDictionary[Any, int] = field(default_factory=weakref.WeakKeyDictionary)
    # set_activation_checkpointing calls waiting for the pipeline partition (module, options...)
    checkpoint_marks: list[tuple[Any, ...]] = field(default_factory=list)
    _offload_scope: Any = None
    _offload_scope_config: SMPConfig | None = None

    @property
    def initialized(self) -> bool:
        return self.cfg is not None

    def config(self) -> SMPConfig:
        """The active config; before ``smp.init`` the library's defaults (a single process)."""
        return self.cfg if self.cfg is not None else parse_config({}, use_environment=False)

    def require_init(self) -> SMPConfig:
        if self.cfg is None:
            raise NotInitializedError()
        return self.cfg

    def offload_scope(self) -> Any:
        """The one ``saved_tensors_scope`` shared by every region of this config (so all regions
        share one prefetch schedule), or None when the config offloads nothing."""
        cfg = self.config()
        if self._offload_scope_config is not cfg:
            self._offload_scope = offload.saved_tensors_scope(cfg)
            self._offload_scope_config = cfg
        return self._offload_scope

    def num_microbatches(self) -> int:
        return self.config().microbatches

    def reset_model_state(self) -> None:
        """Forget the wrapped model and optimizer (upstream ``smp.reset()``)."""
        self.model = None
        self.optimizer = None
        self.in_step_func = False
        self.microbatch = 0
        self.post_partition_hooks.clear()
        self.checkpoint_marks.clear()

    def reset(self) -> None:
        """Back to the state before ``smp.init``."""
        self.reset_model_state()
        self.cfg = None
        self.placements.clear()
        self._offload_scope = self._offload_scope_config = None


state = SMPState()

__all__ = ["state"]
