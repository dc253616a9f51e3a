"""FairScale's activation-checkpointing API on the acshim engine.

``import fairscale`` becomes ``from acshim.facades import fairscale``; ``from fairscale.nn.checkpoint
import checkpoint_wrapper`` becomes ``from acshim.facades.fairscale.nn.checkpoint import
checkpoint_wrapper``. Only activation checkpointing is covered (``fairscale.nn.checkpoint``, its
re-exports in ``fairscale.nn`` and the deprecated ``fairscale.nn.misc``, ``patch_batchnorm``, and
``fairscale.nn.pipe``'s own ``is_checkpointing`` / ``is_recomputing``); FSDP, Pipe, OSS and the rest
are not.
"""

from __future__ import annotations

from . import nn

__version__ = "0.4.13"
"""The FairScale release whose checkpointing API this facade follows."""

_ACTIVATIONS = "fairscale.nn.checkpoint.checkpoint_activations"
_FACADE_ACTIVATIONS = "acshim.facades.fairscale.nn.checkpoint.checkpoint_activations"

# Entry points replaced in place when the real fairscale is installed. ``from x import name``
# copies bindings, so every module that re-exports a name is listed.
ACSHIM_PATCHES: list[tuple[str, str, str]] = [
    (_ACTIVATIONS, "checkpoint_wrapper", f"{_FACADE_ACTIVATIONS}.checkpoint_wrapper"),
    (_ACTIVATIONS, "is_checkpointing", f"{_FACADE_ACTIVATIONS}.is_checkpointing"),
    (_ACTIVATIONS, "is_recomputing", f"{_FACADE_ACTIVATIONS}.is_recomputing"),
    (_ACTIVATIONS, "disable_checkpointing", f"{_FACADE_ACTIVATIONS}.disable_checkpointing"),
    (_ACTIVATIONS, "enable_checkpointing", f"{_FACADE_ACTIVATIONS}.enable_checkpointing"),
    (_ACTIVATIONS, "enable_recomputing", f"{_FACADE_ACTIVATIONS}.enable_recomputing"),
    (_ACTIVATIONS, "patch_batchnorm", "acshim.facades.fairscale.nn.checkpoint.checkpoint_utils.patch_batchnorm"),
    ("fairscale.nn.checkpoint.checkpoint_utils", "patch_batchnorm",
     "acshim.facades.fairscale.nn.checkpoint.checkpoint_utils.patch_batchnorm"),
    ("fairscale.nn.checkpoint", "checkpoint_wrapper", f"{_FACADE_ACTIVATIONS}.checkpoint_wrapper"),
    ("fairscale.nn.checkpoint", "is_checkpointing", f"{_FACADE_ACTIVATIONS}.is_checkpointing"),
    ("fairscale.nn.checkpoint", "is_recomputing", f"{_FACADE_ACTIVATIONS}.is_recomputing"),
    ("fairscale.nn", "checkpoint_wrapper", f"{_FACADE_ACTIVATIONS}.checkpoint_wrapper"),
    ("fairscale.nn.misc", "checkpoint_wrapper", f"{_FACADE_ACTIVATIONS}.checkpoint_wrapper"),
]

__all__ = ["ACSHIM_PATCHES", "nn"]
