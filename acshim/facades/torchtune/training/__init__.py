"""``torchtune.training`` as far as activation offloading needs it."""

from __future__ import annotations

from ._activation_offloading import NoOpManager, OffloadActivations, get_act_offloading_ctx_manager

__all__ = ["NoOpManager", "OffloadActivations", "get_act_offloading_ctx_manager"]
