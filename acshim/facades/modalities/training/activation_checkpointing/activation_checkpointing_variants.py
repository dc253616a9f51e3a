"""``ActivationCheckpointingVariants``: the three Modalities variants, with upstream's string values."""

from __future__ import annotations

from enum import Enum


class ActivationCheckpointingVariants(Enum):
    """Which blocks are checkpointed and how much of each is kept."""

    FULL_ACTIVATION_CHECKPOINTING = "full_activation_checkpointing"
    SELECTIVE_LAYER_ACTIVATION_CHECKPOINTING = "selective_layer_activation_checkpointing"
    SELECTIVE_OP_ACTIVATION_CHECKPOINTING = "selective_op_activation_checkpointing"
