"""Checkpoint one transformers model's blocks in place with the engine, and undo it."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..apply import build_options
from ..options import RegionOptions
from ..policy import EveryNth, ModuleTarget, PolicyLike, SequentialTarget, as_policy
from ..wrap import checkpoint_sequential_groups, checkpointed_forward_of, uncheckpoint_module
from .blocks import HFBlocks
from .caching import add_cache_hook, remove_cache_hooks
from .offload import with_offload
from .region import checkpoint_hf_block, named_hf


def checkpoint_model(model: nn.Module, policy: PolicyLike = None, *, every_n_layers: int = 1, offload: bool = False,
                     options: RegionOptions | None = None, **option_changes: Any) -> list[str]:
    """Make ``model``'s repeated blocks engine regions, in place (what ``patch_transformers`` does to
    every new model). Returns the names of the blocks made into regions.

    ``policy``: which modules (default: ``HFBlocks()`` - layer class, else ``_no_split_modules``,
    else the largest set of identical blocks). ``every_n_layers``: keep only blocks 0, n, 2n...
    (transformers 5.x meaning). ``offload``: move each region's saved inputs to the storage tier.
    Other keywords are ``RegionOptions`` fields (``reentrant``, ``preserve_rng_state``...).
    Earlier acshim regions in ``model`` are replaced, never nested.
    """
    region_options = named_hf(with_offload(build_options(options, **option_changes), offload))
    chosen = HFBlocks() if policy is None else as_policy(policy)
    if every_n_layers != 1:
        chosen = EveryNth(every_n_layers, of=chosen)
    uncheckpoint_model(model)
    names = []
    for target in chosen.select(model):
        if isinstance(target, SequentialTarget):
            checkpoint_sequential_groups(target.module, region_options, target.groups, target.pack_args_as_tuple)
        elif isinstance(target, ModuleTarget):
            checkpoint_hf_block(target.module, region_options)
        names.append(target.name)
    if names:
        add_cache_hook(model)
    return names


def uncheckpoint_model(model: nn.Module) -> list[str]:
    """Remove every acshim region and cache hook from ``model``; returns the names restored."""
    restored = [name for name, module in model.named_modules() if uncheckpoint_module(module)]
    remove_cache_hooks(model)
    return restored


def acshim_regions(model: nn.Module) -> list[str]:
    """Names of the in-place acshim regions in ``model``."""
    return [name for name, module in model.named_modules() if checkpointed_forward_of(module) is not None]


def upstream_checkpointing_on(model: nn.Module) -> bool:
    """transformers' ``is_gradient_checkpointing`` without its 5.x deprecation warning."""
    return any(getattr(module, "gradient_checkpointing", False) is True for module in model.modules())
