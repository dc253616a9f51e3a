"""Apply a policy to a model: its chosen submodules become checkpointed regions in place."""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn

from .options import RegionOptions
from .policy import ModuleTarget, PolicyLike, SequentialTarget, as_policy
from .wrap import (
    checkpoint_module,
    checkpoint_sequential_groups,
    checkpointed_forward_of,
    uncheckpoint_module,
)

_OPTION_FIELDS = set(RegionOptions.__dataclass_fields__)
APPLIED_ATTRIBUTE = "_acshim_applied_forward"
"""Instance attribute: the region forward ``apply_checkpointing`` installed on the module (copies
and pickles with it), so applying again can tell its own regions apart."""


def build_options(options: RegionOptions | None = None, **changes: Any) -> RegionOptions:
    """``options`` (or the defaults) with ``changes`` applied; unknown names are rejected."""
    if options is not None and not isinstance(options, RegionOptions):
        raise TypeError(f"options must be a RegionOptions or None, got {type(options).__name__}; pass single "
                        "options as keywords instead, e.g. reentrant=True")
    unknown = sorted(set(changes) - _OPTION_FIELDS)
    if unknown:
        raise TypeError(f"unknown checkpointing option(s) {', '.join(unknown)}; known: {', '.join(sorted(_OPTION_FIELDS))}")
    base = options or RegionOptions()
    return base.replace(**changes) if changes else base


def apply_checkpointing(model: nn.Module, policy: PolicyLike = None, *, options: RegionOptions | None = None,
                        storage: str | None = None, prefetch: int | None = None, directory: str | None = None,
                        **option_changes: Any) -> list[str]:
    """Turn the submodules ``policy`` selects into checkpointed regions, in place.

    ``policy``: a ``Policy`` (``Blocks``, ``ByClass``, ``ByName``, ``Predicate``, ``EveryNth``,
    ``SequentialStrategy``) or a shorthand (None = the repeated blocks, a class, a name glob, a
    predicate). Remaining keywords are ``RegionOptions`` fields (``reentrant``,
    ``preserve_rng_state``, ``context_fn``…). ``storage`` (``"host"`` or ``"disk"``), ``prefetch``
    and ``directory`` send every region's saved inputs to the storage tier, shared by the model's
    regions so backward fetches ``prefetch`` regions ahead (see ``acshim.offload``). Module objects,
    parameters and ``state_dict`` keys are unchanged.
    Idempotent: applying again re-targets without nesting: regions an earlier call made that the
    new policy leaves out are removed, the others take the new options. Returns the names made
    into regions.

    >>> acshim.apply_checkpointing(model)                       # every transformer block
    >>> acshim.apply_checkpointing(model, acshim.EveryNth(2))   # every other block
    """
    _require_module("apply_checkpointing", model)
    if storage is None and (prefetch is not None or directory is not None):
        raise ValueError("apply_checkpointing: prefetch= and directory= configure the storage tier; pass "
                         "storage='host' or storage='disk' as well")
    if storage is not None:
        from .storage import region_option_changes

        option_changes.update(region_option_changes(storage=storage, prefetch=prefetch, directory=directory))
    region_options = build_options(options, **option_changes)
    chosen = as_policy(policy)
    targets = chosen.select(model)
    if not targets:
        warnings.warn(f"apply_checkpointing: {chosen!r} selected no module of {type(model).__name__}; nothing is "
                      "checkpointed. Pass a policy such as ByClass(MyBlock) or ByName('layers.*').", stacklevel=2)
    previous = _applied_regions(model)
    names = []
    for target in targets:
        if isinstance(target, SequentialTarget):
            checkpoint_sequential_groups(target.module, region_options, target.groups, target.pack_args_as_tuple)
        elif isinstance(target, ModuleTarget):
            checkpoint_module(target.module, region_options)
        target.module.__dict__[APPLIED_ATTRIBUTE] = checkpointed_forward_of(target.module)
        names.append(target.name)
    chosen_now = {id(target.module) for target in targets}
    for module in previous:  # re-targeting: earlier regions the new policy leaves out are removed
        if id(module) not in chosen_now:
            _unapply(module)
    return names


def _applied_regions(model: nn.Module) -> list[nn.Module]:
    """Modules of ``model`` whose region ``apply_checkpointing`` installed (and nothing replaced
    since: a facade's or ``checkpoint_module``'s own regions are left alone when re-targeting)."""
    return [module for module in model.modules()
            if (forward := module.__dict__.get(APPLIED_ATTRIBUTE)) is not None and forward is checkpointed_forward_of(module)]


def _unapply(module: nn.Module) -> bool:
    module.__dict__.pop(APPLIED_ATTRIBUTE, None)
    return uncheckpoint_module(module)


def _require_module(function: str, model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{function} needs an nn.Module as its first argument (the model), got {type(model).__name__}")


def remove_checkpointing(model: nn.Module) -> list[str]:
    """Undo ``apply_checkpointing`` everywhere in ``model`` (and a plan's ``acshim.head`` choice);
    returns the names restored."""
    from . import head

    _require_module("remove_checkpointing", model)
    head.remove(model)
    return [name for name, module in model.named_modules() if _unapply(module)]


def checkpointed_modules(model: nn.Module) -> list[str]:
    """Names of the submodules of ``model`` that are checkpointed regions."""
    _require_module("checkpointed_modules", model)
    return [name for name, module in model.named_modules() if checkpointed_forward_of(module) is not None]
