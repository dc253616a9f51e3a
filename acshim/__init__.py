"""acshim: one activation-checkpointing engine behind the APIs of DeepSpeed, FairScale, SageMaker
model parallelism, PyTorch's checkpoint_wrapper, Modalities and Hugging Face."""

from __future__ import annotations

from . import allocator as _allocator

if _allocator.invoked_as_budget_command():  # before torch is imported: acshim run --budget owns malloc
    _allocator.own()

from . import (
    _quiet_torch,  # noqa: F401  (first: torch imported without its NumPy-missing warning)
    _source_layout,  # noqa: F401  (in a source checkout, maps backends/ and csrc/ before any import of them)
)
from . import exit_settle as _exit_settle
from . import vml_dispatch as _vml_dispatch
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

_vml_dispatch.settle()  # before the script's first tensor op (see vml_dispatch)
_exit_settle.register()  # ranks that end right after a collective exit cleanly (see exit_settle)

# Names provided by subpackages that import heavier dependencies, loaded on first access.
_LAZY = {
    "install": ("acshim.patching", "install"),
    "uninstall": ("acshim.patching", "uninstall"),
    "patch_transformers": ("acshim.hf", "patch_transformers"),
    "unpatch_transformers": ("acshim.hf", "unpatch_transformers"),
    "offload": ("acshim.storage", "offload"),
    "plan": ("acshim.planner", "plan"),
    "Plan": ("acshim.planner", "Plan"),
}


# Subpackages the documentation names as ``acshim.<name>.…`` after a bare ``import acshim``.
_SUBPACKAGES = ("selective", "storage", "testing", "hf", "patching", "facades", "backends", "head")


def __getattr__(name: str) -> object:
    if name in _LAZY or name in _SUBPACKAGES:
        import importlib

        if name in _SUBPACKAGES:
            return importlib.import_module(f"acshim.{name}")  # importing binds it as an attribute
        module_name, attribute = _LAZY[name]
        value = getattr(importlib.import_module(module_name), attribute)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'acshim' has no attribute {name!r}")

__all__ = [
    "Blocks", "ByClass", "ByName", "EveryNth", "MemoryReport", "Policy", "Predicate", "RNGStatesTracker",
    "RegionOptions", "SequentialStrategy", "apply_checkpointing", "build_options", "checkpoint",
    "checkpoint_module", "checkpointed_modules", "disable_checkpointing", "find_blocks", "get_rng_tracker",
    "is_checkpointing", "is_recomputing", "measure_memory", "remove_checkpointing", "run_region",
    "uncheckpoint_module", "install", "uninstall", "patch_transformers", "unpatch_transformers", "offload",
    "plan", "Plan",
]
