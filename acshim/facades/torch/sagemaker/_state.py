"""``torch.sagemaker.state``: what SMP v2 decided at ``init``, for one process or plain torch.distributed.

In the native-PyTorch fallback (tensor, expert and context parallel degree 1, the only ones a
single process can have) SMP creates no process groups of its own: ``tp_process_group``,
``rep_rank_process_group`` and friends are None, as the docs state; ``world_process_group`` is
torch's WORLD group when torch.distributed is initialised. Ranks come from torch.distributed when
it is initialised, else the process is rank 0 of 1.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from acshim.rng import get_rng_tracker

from ._config import DEFAULTS


def world() -> tuple[int, int]:
    """``(rank, world_size)`` from torch.distributed, or ``(0, 1)`` when it is not initialised."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class SMPState:
    """Attributes scripts read after ``tsm.init()``; ``reset()`` goes back to before it."""

    get_rng_state_tracker: Callable[[], Any] = staticmethod(get_rng_tracker)
    """The RNG tracker (Megatron/TE method names) that checkpointed regions save and restore."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.initialized = False
        self.config: dict[str, Any] = dict(DEFAULTS)
        self.offload_status = "off"
        self._apply(self.config)

    def _apply(self, config: dict[str, Any]) -> None:
        """Set the attributes from a validated config."""
        self.config = dict(config)
        for key, value in config.items():
            setattr(self, key, value)
        self.rank, self.world_size = world()
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.tp_size = self.tensor_parallel_degree
        self.ep_size = self.expert_parallel_degree
        self.cp_size = self.context_parallel_degree
        self.tp_rank = self.ep_rank = self.cp_rank = 0
        self.rep_rank = self.rank
        self.tp_process_group = self.rep_rank_process_group = None
        self.ep_process_group = self.cp_process_group = None
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.world_process_group = torch.distributed.group.WORLD if distributed else None

    def __repr__(self) -> str:
        return f"SMPState(initialized={self.initialized}, {self.config})"


state = SMPState()
