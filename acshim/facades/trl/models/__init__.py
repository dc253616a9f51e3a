"""``trl.models`` as far as activation offloading needs it."""

from __future__ import annotations

from .activation_offloading import get_act_offloading_ctx_manager

__all__ = ["get_act_offloading_ctx_manager"]
