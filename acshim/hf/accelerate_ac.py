"""Accelerate's FSDP activation checkpointing on the engine.

``accelerate.utils.fsdp_utils.fsdp2_apply_ac`` (Accelerate 1.x, FSDP2) replaces each layer its
auto-wrap policy accepts with ``checkpoint_wrapper(layer, preserve_rng_state=False)`` and, with
``activation_checkpointing_offload``, ``offload_wrapper`` around it. acshim's version makes the
same layers in-place engine regions before ``fully_shard``. Deliberate differences ("better"):
RNG state is preserved (dropout masks repeat, gradients equal the run without checkpointing),
module names and ``state_dict`` keys do not change (no ``_checkpoint_wrapped_module``), a layer
inside another accepted layer is not checkpointed twice, offload goes to the storage tier (never
copies CPU tensors to the CPU), and a plugin without an auto-wrap policy falls back to the
model's blocks instead of failing with ``'NoneType' object is not callable``.

FSDP1 (``Accelerator.prepare_model``) imports torch's ``apply_activation_checkpointing`` /
``checkpoint_wrapper`` inside the function; those are routed by acshim's PyTorch facade.
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

from ..options import RegionOptions
from ..policy import Predicate
from .blocks import HFBlocks
from .models import checkpoint_model
from .offload import with_offload
from .patches import AttributePatch, PatchSet

_patches = PatchSet()
PATCH_SITES = ("accelerate.utils.fsdp_utils", "accelerate.utils", "accelerate.accelerator")


def fsdp2_apply_ac(accelerator: Any, model: nn.Module) -> nn.Module:
    """Apply FSDP activation checkpointing to ``model`` with the acshim engine; returns ``model``.

    Mirrors ``accelerate.utils.fsdp_utils.fsdp2_apply_ac(accelerator, model)``: the layers chosen
    by ``fsdp2_prepare_auto_wrap_policy`` (``transformer_cls_names_to_wrap`` or the model's
    ``_no_split_modules``; unknown names raise upstream's ``ValueError``), offload per
    ``fsdp_plugin.activation_checkpointing_offload``.
    """
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    plugin = accelerator.state.fsdp_plugin
    accepts = fsdp2_prepare_auto_wrap_policy(plugin, model)
    policy = HFBlocks() if accepts is None else Predicate(lambda module: bool(accepts(module)))
    options = with_offload(RegionOptions(), bool(getattr(plugin, "activation_checkpointing_offload", False)))
    checkpoint_model(model, policy, options=options)
    return model


def patch_accelerate() -> None:
    """Point every name Accelerate calls ``fsdp2_apply_ac`` by at acshim's (idempotent; only the
    modules already imported)."""
    if _patches:
        return
    patches = [AttributePatch(sys.modules[site], "fsdp2_apply_ac", fsdp2_apply_ac)
               for site in PATCH_SITES if site in sys.modules and hasattr(sys.modules[site], "fsdp2_apply_ac")]
    _patches.apply(patches)


def unpatch_accelerate() -> None:
    _patches.restore()


def accelerate_patched() -> bool:
    return bool(_patches)
