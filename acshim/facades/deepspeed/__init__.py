"""DeepSpeed facade: ``from acshim.facades import deepspeed`` in place of ``import deepspeed``.

Covers DeepSpeed's activation checkpointing (``deepspeed.checkpointing``, the module
``deepspeed.runtime.activation_checkpointing.checkpointing``) on the acshim engine. Unlike
upstream, ``import acshim.facades.deepspeed.checkpointing`` also works (upstream has no such file).

``ACSHIM_PATCHES`` names the entry points ``acshim.install()`` / ``acshim run`` replace in place when
the real DeepSpeed is installed; they point at ``_upstream`` wrappers that keep the real module's
globals (``PARTITION_ACTIVATIONS``, ``mpu``, ...) as the one state during each call.
"""

from __future__ import annotations

import sys

from .runtime.activation_checkpointing import checkpointing

__version__ = "0.19.8+acshim"
"""The DeepSpeed API level this facade mirrors."""

# `import acshim.facades.deepspeed.checkpointing` finds the same module object as the attribute.
sys.modules[__name__ + ".checkpointing"] = checkpointing

UPSTREAM_CHECKPOINTING = "deepspeed.runtime.activation_checkpointing.checkpointing"

PATCHED_NAMES = (
    "checkpoint",
    "non_reentrant_checkpoint",
    "configure",
    "is_configured",
    "reset",
    "get_cuda_rng_tracker",
    "model_parallel_cuda_manual_seed",
    "model_parallel_reconfigure_tp_seed",
    "partition_activations_in_checkpoint",
    "set_num_layers",
)

UPSTREAM_OFFLOAD = "deepspeed.runtime.activation_checkpointing.offload_activations"
FACADE_OFFLOAD = "acshim.facades.deepspeed.runtime.activation_checkpointing.offload_activations"
OFFLOAD_NAMES = (
    "CheckpointActivationOffloadStats",
    "CheckpointHiddenStatesOffload",
    "get_checkpoint_hidden_states_offloading_ctx_manager",
    "patch_gradient_checkpointing_layer_marker",
)
"""Hidden-state offload (DeepSpeed 0.19): replaced whole by the facade's objects, which run on
acshim's storage tier (upstream's own ``cpu_checkpointing`` engine is left to ``checkpointing``)."""

ACSHIM_PATCHES: list[tuple[str, str, str]] = [
    (UPSTREAM_CHECKPOINTING, name, f"acshim.facades.deepspeed._upstream.{name}") for name in PATCHED_NAMES
] + [(UPSTREAM_OFFLOAD, name, f"{FACADE_OFFLOAD}.{name}") for name in OFFLOAD_NAMES]

__all__ = ["ACSHIM_PATCHES", "checkpointing"]
