"""``fairscale.nn``: the activation-checkpointing part (``checkpoint_wrapper`` and the
``checkpoint``, ``misc`` and ``pipe`` subpackages' checkpointing names)."""

from __future__ import annotations

from . import checkpoint, misc, pipe
from .checkpoint import checkpoint_wrapper

# Upstream names outside activation checkpointing that this facade does not provide.
_NOT_PROVIDED = {
    "FullyShardedDataParallel", "ShardedDataParallel", "MOELayer", "Top2Gate", "Pipe", "PipeRPCWrapper",
    "FlattenParamsWrapper", "auto_wrap", "config_auto_wrap_policy", "default_auto_wrap_policy", "enable_wrap",
    "wrap",
}


def __getattr__(name: str) -> object:
    if name in _NOT_PROVIDED:
        raise AttributeError(
            f"fairscale.nn.{name} is not provided by acshim's FairScale facade, which covers activation "
            "checkpointing only (checkpoint_wrapper, is_checkpointing, is_recomputing, disable_checkpointing, "
            "patch_batchnorm); install fairscale to use it")
    raise AttributeError(f"module 'fairscale.nn' has no attribute {name!r}")


__all__ = ["checkpoint", "checkpoint_wrapper", "misc", "pipe"]
