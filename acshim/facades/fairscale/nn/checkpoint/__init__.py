"""``fairscale.nn.checkpoint``: ``checkpoint_wrapper``, ``is_checkpointing``, ``is_recomputing``."""

from __future__ import annotations

from .checkpoint_activations import checkpoint_wrapper, is_checkpointing, is_recomputing

__all__ = ["checkpoint_wrapper", "is_checkpointing", "is_recomputing"]
