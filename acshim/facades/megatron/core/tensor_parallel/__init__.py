"""``megatron.core.tensor_parallel``: the checkpoint and RNG-tracker names of ``random``."""

from .random import (
    CheckpointWithoutOutput,
    CudaRNGStatesTracker,
    checkpoint,
    get_all_rng_states,
    get_cuda_rng_tracker,
    get_data_parallel_rng_tracker_name,
    get_expert_parallel_rng_tracker_name,
    initialize_rng_tracker,
    model_parallel_cuda_manual_seed,
)

__all__ = [
    "CheckpointWithoutOutput", "CudaRNGStatesTracker", "checkpoint", "get_all_rng_states", "get_cuda_rng_tracker",
    "get_data_parallel_rng_tracker_name", "get_expert_parallel_rng_tracker_name", "initialize_rng_tracker",
    "model_parallel_cuda_manual_seed",
]
