"""acshim: one activation-checkpointing engine behind the APIs of DeepSpeed, FairScale, SageMaker
model parallelism, PyTorch's checkpoint_wrapper, Modalities and Hugging Face."""

from __future__ import annotations

from .apply import apply_checkpointing, build_options, checkpointed_modules, remove_checkpointing
from .blocks import find_blocks
from .dropin import checkpoint
from .measure import MemoryReport, measure_memory
from .options import RegionOptions
from .policy import Blocks, ByClass, ByName, EveryNth, Policy, Predicate, SequentialStrategy
from .region import run_region
from .rng import RNGStatesTracker, get_rng_tracker
from .state import disable_checkpointing, is_checkpointing, is_recomputing
from .wrap import checkpoint_module, uncheckpoint_module

__version__ = "0.1.0"

__all__ = [
    "Blocks", "ByClass", "ByName", "EveryNth", "MemoryReport", "Policy", "Predicate", "RNGStatesTracker",
    "RegionOptions", "SequentialStrategy", "apply_checkpointing", "build_options", "checkpoint",
    "checkpoint_module", "checkpointed_modules", "disable_checkpointing", "find_blocks", "get_rng_tracker",
    "is_checkpointing", "is_recomputing", "measure_memory", "remove_checkpointing", "run_region",
    "uncheckpoint_module",
]
