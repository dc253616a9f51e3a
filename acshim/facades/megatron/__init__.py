"""Megatron-core facade: ``megatron.core.tensor_parallel``'s checkpointing and RNG tracker
(megatron/core/tensor_parallel/random.py, megatron-core 0.16.1) on the acshim engine.

With megatron-core installed, ``acshim.install()`` / ``acshim run`` replace the names in
``ACSHIM_PATCHES`` in place (and every copy other ``megatron.*`` modules bound by name), so
``TransformerConfig``'s recompute keys keep upstream's own validation and layer choice
(``TransformerBlock._checkpointed_forward``, ``TransformerLayer``'s ``recompute_modules``) while each
``tensor_parallel.checkpoint`` runs as one reentrant engine region and every RNG stream lives in
acshim's device-generic tracker; ``cpu_offloading`` and ``fine_grained_activation_offloading``
(``_offload``, ``_fine_grained``) send activations to acshim's storage tier. Without megatron-core, ``import megatron.core.tensor_parallel``
is served from here (checkpoint and RNG names only; no model code).
"""

from __future__ import annotations

__version__ = "0.16.1+acshim"
"""The megatron-core API level this facade mirrors."""

UPSTREAM_RANDOM = "megatron.core.tensor_parallel.random"
FACADE_RANDOM = "acshim.facades.megatron.core.tensor_parallel.random"
UPSTREAM_FINE_GRAINED = "megatron.core.pipeline_parallel.fine_grained_activation_offload"

PATCHED_NAMES = (
    "checkpoint",
    "CheckpointWithoutOutput",
    "CudaRNGStatesTracker",
    "initialize_rng_tracker",
    "get_cuda_rng_tracker",
    "get_all_rng_states",
    "model_parallel_cuda_manual_seed",
    "_get_all_rng_states",
    "_set_all_rng_states",
    "_fork_rng",
)
"""``_get_all_rng_states`` / ``_set_all_rng_states`` / ``_fork_rng`` are replaced too: other upstream
code (CUDA-graph capture, MoE) reads the RNG through them."""

ACSHIM_PATCHES: list[tuple[str, str, str]] = [
    (UPSTREAM_RANDOM, name, f"{FACADE_RANDOM}.{name}") for name in PATCHED_NAMES
] + [
    # None without Transformer Engine: TransformerBlock then refuses cpu_offloading; acshim serves it
    ("megatron.core.transformer.transformer_block", "get_cpu_offload_context",
     "acshim.facades.megatron._offload.get_cpu_offload_context"),
    # upstream's manager builds CUDA streams; acshim's puts each chunk's offloaded modules on the tier
    (UPSTREAM_FINE_GRAINED, "FineGrainedActivationOffloadingInterface",
     "acshim.facades.megatron._fine_grained.FineGrainedActivationOffloadingInterface"),
]

__all__ = ["ACSHIM_PATCHES"]
