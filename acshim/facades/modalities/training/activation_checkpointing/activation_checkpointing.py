"""``modalities.training.activation_checkpointing.activation_checkpointing`` on the acshim engine.

Mirrors Modalities (src/modalities/training/activation_checkpointing/activation_checkpointing.py):
``ActivationCheckpointing.apply_activation_checkpointing_`` replaces each child of the
``nn.ModuleDict`` at ``layers_fqn`` by a torch-style ``CheckpointWrapper`` (full, every
``ac_freq``-th, or selective-op with ``SAVE_DICT`` ops saved), and
``apply_activation_checkpointing_fsdp1_inplace`` wraps the named block classes of an FSDP1 model.
The wrappers are acshim's torch facade, so recompute runs on the engine.

Deliberate differences (all "better"):
- RNG state is preserved. Upstream hard-codes ``preserve_rng_state=False``, so with dropout the
  recomputed masks differ from the forward's and gradients are wrong; here they are bitwise equal
  to training without checkpointing. The signatures are unchanged.
- The selective-layer counter lives in one call. Upstream keeps it on torch's ``checkpoint_wrapper``
  function object, so a second model (or call) continues the count and picks other layers.
- Bad parameters fail when applied, naming the fix: an unknown ``save_ops_keys`` entry (upstream: a
  KeyError at the first forward), ``ac_freq < 1`` (upstream: ZeroDivisionError or a pydantic error),
  an unknown class name for FSDP1 (upstream: a TypeError from ``isinstance`` at wrap time).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from acshim import selective
from acshim.facades.torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
)
from acshim.facades.torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper as ptd_checkpoint_wrapper,
)
from acshim.region_dialect import made_by

from .activation_checkpointing_variants import ActivationCheckpointingVariants

_ops = torch.ops

DIALECT = "modalities"
"""How ``acshim run --report`` names the regions of the wrappers built here."""


def print_rank_0(message: str) -> None:
    """Print on rank 0 only when a process group is up (Modalities' progress messages)."""
    distributed = torch.distributed
    if not (distributed.is_available() and distributed.is_initialized()) or distributed.get_rank() == 0:
        print(message, flush=True)


def _module_class_from_name(module: nn.Module, name: str) -> type[nn.Module] | None:
    """The class of the first module (depth first, the module itself first) whose class is called ``name``."""
    for submodule in module.modules():
        if type(submodule).__name__ == name:
            return type(submodule)
    return None


def is_module_to_apply_activation_checkpointing(submodule: nn.Module, activation_checkpointing_modules: list[type]) -> bool:
    """Whether ``submodule`` is an instance of one of ``activation_checkpointing_modules``."""
    return isinstance(submodule, tuple(activation_checkpointing_modules))


def apply_activation_checkpointing_fsdp1_inplace(model: nn.Module, activation_checkpointing_modules: list[str]) -> None:
    """Checkpoint (non-reentrant) every submodule of the FSDP1-wrapped ``model`` whose class name is
    in ``activation_checkpointing_modules``, in place."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    module_types = [_module_class_from_name(model, name) for name in activation_checkpointing_modules]
    if not isinstance(model, FSDP1):
        raise ValueError(
            "This activation checkpointing component can only be applied to FSDP1 wrapped models. "
            "Use the respective FSDP2 component for FSDP2 models."
        )
    unknown = [name for name, found in zip(activation_checkpointing_modules, module_types) if found is None]
    if unknown:
        raise ValueError(
            f"activation_checkpointing_modules: no module of class {', '.join(map(repr, unknown))} in the model; "
            "list class names of modules the model contains (e.g. its transformer block class)")
    non_reentrant_wrapper = partial(ptd_checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT, debug=False)
    with made_by(DIALECT):  # the wrappers' regions are reported as Modalities'
        apply_activation_checkpointing(
            model,
            checkpoint_wrapper_fn=non_reentrant_wrapper,
            check_fn=lambda submodule: is_module_to_apply_activation_checkpointing(submodule, module_types),
        )


def _variant(ac_variant: Any) -> ActivationCheckpointingVariants:
    """Our enum member for ``ac_variant``: a member of this enum or of the real Modalities enum, or its value."""
    try:
        return ActivationCheckpointingVariants(getattr(ac_variant, "value", ac_variant))
    except ValueError:
        raise ValueError(f"Unknown activation checkpointing variant: {ac_variant}") from None


class ActivationCheckpointing:
    """Activation checkpointing of a model's transformer blocks, in Modalities' three variants:
    full (every block recomputed), selective layer (every ``ac_freq``-th block) and selective op
    (every block, but the outputs of the ``SAVE_DICT`` ops named in ``save_ops_keys`` are kept,
    except every second matmul)."""

    SAVE_DICT: dict[str, Any] = {
        "ops.aten.mm.default": _ops.aten.mm.default,
        "ops.aten._scaled_dot_product_efficient_attention.default": _ops.aten._scaled_dot_product_efficient_attention.default,
        "ops.aten._scaled_dot_product_flash_attention.default": _ops.aten._scaled_dot_product_flash_attention.default,
        "ops._c10d_functional.reduce_scatter_tensor.default": _ops._c10d_functional.reduce_scatter_tensor.default,
        "ops.aten.max.default": _ops.aten.max.default,
    }

    @staticmethod
    def apply_activation_checkpointing_(ac_variant: ActivationCheckpointingVariants, layers_fqn: str, model: nn.Module,
                                        ac_fun_params: Any) -> None:
        """Checkpoint the children of ``model.get_submodule(layers_fqn)`` (an ``nn.ModuleDict``) in place.

        ``ac_fun_params``: ``FullACParams`` (no fields), ``SelectiveLayerACParams`` (``ac_freq``) or
        ``SelectiveOpACParams`` (``save_ops_keys``, keys of ``SAVE_DICT``). Each chosen block is
        replaced by a ``CheckpointWrapper`` (FQNs gain ``_checkpoint_wrapped_module``).

        Raises ValueError for an unknown variant, empty ``save_ops_keys`` or a ``layers_fqn`` that
        is not a ModuleDict; KeyError for an unknown ``save_ops_keys`` entry.
        """
        variant = _variant(ac_variant)
        if variant is ActivationCheckpointingVariants.FULL_ACTIVATION_CHECKPOINTING:
            wrap: Callable[[nn.Module], nn.Module] = ActivationCheckpointing._apply_full_ac
        elif variant is ActivationCheckpointingVariants.SELECTIVE_LAYER_ACTIVATION_CHECKPOINTING:
            wrap = ActivationCheckpointing._every_nth_layer(ac_fun_params.ac_freq)
        else:
            if len(ac_fun_params.save_ops_keys) == 0:
                raise ValueError("No save_ops_keys provided for selective op activation checkpointing.")
            wrap = partial(ActivationCheckpointing._apply_selective_op_ac, save_ops_keys=ac_fun_params.save_ops_keys)
            ActivationCheckpointing._save_ops(ac_fun_params.save_ops_keys)  # fail now, not at the first forward

        layers = model.get_submodule(layers_fqn)
        if not isinstance(layers, nn.ModuleDict):
            raise ValueError(f"layers_fqn {layers_fqn} does not reference a ModuleDict")

        children = list(layers.named_children())
        print_rank_0(f"Applying activation checkpointing to {len(children)} layers...")
        with made_by(DIALECT):  # the wrappers' regions are reported as Modalities'
            for layer_id, transformer_block in children:
                print_rank_0(f"Applying activation checkpointing to {layer_id}...")
                layers.register_module(layer_id, wrap(transformer_block))

    @staticmethod
    def _apply_full_ac(module: nn.Module) -> nn.Module:
        # preserve_rng_state=True where upstream passes False: dropout masks must match in recompute.
        return ptd_checkpoint_wrapper(module, preserve_rng_state=True)

    @staticmethod
    def _every_nth_layer(ac_freq: int) -> Callable[[nn.Module], nn.Module]:
        """A wrap function that checkpoints the ``ac_freq``-th, ``2*ac_freq``-th, ... block it is
        given. Its counter belongs to this one application (upstream's is process-global)."""
        if isinstance(ac_freq, bool) or not isinstance(ac_freq, int) or ac_freq < 1:
            raise ValueError(f"ac_freq must be an integer >= 1 (checkpoint every ac_freq-th layer), got {ac_freq!r}")
        seen = 0

        def wrap(module: nn.Module) -> nn.Module:
            nonlocal seen
            seen += 1
            if seen % ac_freq == 0:
                return ptd_checkpoint_wrapper(module, preserve_rng_state=True)
            return module

        return wrap

    @staticmethod
    def _save_ops(save_ops_keys: list[str]) -> frozenset[Any]:
        unknown = [key for key in save_ops_keys if key not in ActivationCheckpointing.SAVE_DICT]
        if unknown:
            raise KeyError(
                f"save_ops_keys: unknown key(s) {unknown}; choose from {sorted(ActivationCheckpointing.SAVE_DICT)}")
        return frozenset(ActivationCheckpointing.SAVE_DICT[key] for key in save_ops_keys)

    @staticmethod
    def _apply_selective_op_ac(module: nn.Module, save_ops_keys: list[str]) -> nn.Module:
        # Modalities' policy is the engine's save-ops rule: listed ops kept, but of aten.mm only
        # the 1st, 3rd, ... call of each region call (forward and recompute counted apart).
        context_fn = selective.save_ops(ActivationCheckpointing._save_ops(save_ops_keys),
                                        recompute_every_other=[_ops.aten.mm.default])
        return ptd_checkpoint_wrapper(module, context_fn=context_fn, preserve_rng_state=True)


_apply_activation_checkpointing_staticmethod = ActivationCheckpointing.__dict__["apply_activation_checkpointing_"]
"""The staticmethod object itself: ``ACSHIM_PATCHES`` puts it on the real class in place of
upstream's, so calls through the class and through instances both work."""


__all__ = [
    "ActivationCheckpointing", "ActivationCheckpointingVariants", "apply_activation_checkpointing_fsdp1_inplace",
    "is_module_to_apply_activation_checkpointing",
]
