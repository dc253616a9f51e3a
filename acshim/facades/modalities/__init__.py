"""Modalities' activation checkpointing (``modalities.training.activation_checkpointing``) on the acshim engine.

``from modalities.training.activation_checkpointing.activation_checkpointing import
ActivationCheckpointing`` becomes ``from acshim.facades.modalities.training.activation_checkpointing
.activation_checkpointing import ActivationCheckpointing``. The parameter classes live where upstream
keeps them (``modalities.config.config.ActivationCheckpointedModelConfig``). The rest of Modalities
(trainer, registry, models) is not provided.
"""

from __future__ import annotations

_AC = "modalities.training.activation_checkpointing.activation_checkpointing"
_FACADE_AC = "acshim.facades.modalities.training.activation_checkpointing.activation_checkpointing"

# Entry points replaced in place when the real modalities is installed. The staticmethod is patched
# on the class (not the class itself), so every module holding a reference to the class sees it.
ACSHIM_PATCHES: list[tuple[str, str, str]] = [
    (_AC, "ActivationCheckpointing.apply_activation_checkpointing_",
     f"{_FACADE_AC}._apply_activation_checkpointing_staticmethod"),
    (_AC, "apply_activation_checkpointing_fsdp1_inplace", f"{_FACADE_AC}.apply_activation_checkpointing_fsdp1_inplace"),
]

__all__ = ["ACSHIM_PATCHES"]
