"""``torch.distributed``: the activation-checkpointing wrappers of
``torch.distributed.algorithms._checkpoint.checkpoint_wrapper`` on the acshim engine.

``from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper`` becomes
``from acshim.facades.torch.distributed.algorithms._checkpoint.checkpoint_wrapper import
checkpoint_wrapper``. Under ``acshim run`` the entry points below are replaced in place in torch's
module. The wrapper classes are listed too: torch's own ``checkpoint_wrapper`` and
``apply_activation_checkpointing`` (bound earlier, e.g. as a default argument or by a library that
imported them first) build whatever ``CheckpointWrapper`` / ``OffloadWrapper`` the module holds, and
the facade's classes subclass torch's, so ``isinstance`` checks against either keep working.
"""

from __future__ import annotations

_TORCH_WRAPPER = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"
_FACADE_WRAPPER = "acshim.facades.torch.distributed.algorithms._checkpoint.checkpoint_wrapper"

ACSHIM_PATCHES: list[tuple[str, str, str]] = [
    (_TORCH_WRAPPER, name, f"{_FACADE_WRAPPER}.{name}")
    for name in ("CheckpointWrapper", "OffloadWrapper", "checkpoint_wrapper", "offload_wrapper",
                 "apply_activation_checkpointing")
]

__all__ = ["ACSHIM_PATCHES"]
