"""Turn a module into a checkpointed region in place: same object, same state_dict keys.

The module gets an instance attribute ``forward`` that runs the class ``forward`` (or the instance
forward it replaced) through ``run_region``. Module hooks stay outside the region, as in FairScale's
``checkpoint_wrapper``. The installed forward holds the module by weak reference (no reference
cycle that delays freeing, fairscale PR #412) but, unlike FairScale's partial, it deep-copies and
pickles correctly: the copy's forward runs the copy.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from .options import RegionOptions
from .region import run_region

MISSING = object()
"""``replaced`` when the module had no instance ``forward`` of its own (``None`` is a value it may have)."""


class CheckpointedForward:
    """The instance ``forward`` of a checkpointed module."""

    def __init__(self, module: nn.Module, options: RegionOptions, replaced: Any = MISSING) -> None:
        self._module = weakref.ref(module)
        self.options = options
        self.replaced = replaced  # the instance attribute ``forward`` had before, if any

    @property
    def module(self) -> nn.Module:
        module = self._module()
        if module is None:
            raise ReferenceError("the checkpointed module no longer exists")
        return module

    def plain_forward(self) -> Callable[..., Any]:
        """The forward this region runs."""
        if self.replaced is not MISSING:
            return self.replaced
        module = self.module
        return type(module).forward.__get__(module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return run_region(self.plain_forward(), args, kwargs, self.options)

    def __deepcopy__(self, memo: dict[int, Any]) -> CheckpointedForward:
        new_module = copy.deepcopy(self.module, memo)
        replaced = self.replaced if self.replaced is MISSING else copy.deepcopy(self.replaced, memo)
        return CheckpointedForward(new_module, self.options, replaced)

    def __reduce__(self) -> tuple[Any, ...]:
        replaced = None if self.replaced is MISSING else self.replaced
        return (_restore_forward, (self.module, self.options, replaced, self.replaced is MISSING))


def _restore_forward(module: nn.Module, options: RegionOptions, replaced: Any, missing: bool) -> CheckpointedForward:
    return CheckpointedForward(module, options, MISSING if missing else replaced)


class CheckpointedSequentialForward(CheckpointedForward):
    """The instance ``forward`` of an ``nn.Sequential`` whose children run in checkpointed groups.

    ``groups`` are lists of consecutive child indexes; each group is one region. A single input is
    passed from child to child; with ``pack_args_as_tuple`` a tuple input is unpacked into the
    region's positional inputs (each tensor gets its own gradient) and handed to the children packed.
    """

    def __init__(self, module: nn.Sequential, options: RegionOptions, groups: Sequence[Sequence[int]],
                 pack_args_as_tuple: bool = False, replaced: Any = MISSING) -> None:
        super().__init__(module, options, replaced)
        self.groups = [list(g) for g in groups]
        self.pack_args_as_tuple = pack_args_as_tuple

    def __call__(self, input: Any) -> Any:
        children = list(self.module)
        for group in self.groups:
            members = [children[i] for i in group]

            def run_group(*packed: Any, members: list[nn.Module] = members) -> Any:
                value = packed if self.pack_args_as_tuple else packed[0]
                for child in members:
                    value = child(value)
                return value

            inputs = tuple(input) if self.pack_args_as_tuple and isinstance(input, (tuple, list)) else (input,)
            input = run_region(run_group, inputs, {}, self.options)
        return input

    def __deepcopy__(self, memo: dict[int, Any]) -> CheckpointedSequentialForward:
        new_module = copy.deepcopy(self.module, memo)
        return CheckpointedSequentialForward(new_module, self.options, self.groups, self.pack_args_as_tuple,
                                             self.replaced)

    def __reduce__(self) -> tuple[Any, ...]:
        return (CheckpointedSequentialForward, (self.module, self.options, self.groups, self.pack_args_as_tuple,
                                                self.replaced))


def checkpointed_forward_of(module: nn.Module) -> CheckpointedForward | None:
    """The region forward installed on ``module``, or None."""
    forward = module.__dict__.get("forward")
    return forward if isinstance(forward, CheckpointedForward) else None


def _check_arguments(function: str, module: Any, options: Any) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"{function} needs an nn.Module, got {type(module).__name__}")
    if not isinstance(options, RegionOptions):
        raise TypeError(f"{function}: options must be a RegionOptions, got {type(options).__name__}; "
                        "build one with acshim.build_options(reentrant=..., ...)")


def checkpoint_module(module: nn.Module, options: RegionOptions) -> nn.Module:
    """Make ``module`` one checkpointed region in place and return it. Idempotent: a module that
    is already a region keeps one region and takes the new options."""
    _check_arguments("checkpoint_module", module, options)
    existing = checkpointed_forward_of(module)
    replaced = existing.replaced if existing is not None else module.__dict__.get("forward", MISSING)
    module.forward = CheckpointedForward(module, options, replaced)
    return module


def checkpoint_sequential_groups(module: nn.Sequential, options: RegionOptions, groups: Sequence[Sequence[int]],
                                 pack_args_as_tuple: bool = False) -> nn.Sequential:
    """Run ``module``'s children as checkpointed ``groups`` of consecutive indexes, in place."""
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"groups of children need an nn.Sequential, got {type(module).__name__}")
    _check_arguments("checkpoint_sequential_groups", module, options)
    flat = [i for g in groups for i in g]
    if flat != list(range(len(module))):
        raise ValueError(f"groups must cover children 0..{len(module) - 1} in order, got {groups}")
    existing = checkpointed_forward_of(module)
    replaced = existing.replaced if existing is not None else module.__dict__.get("forward", MISSING)
    module.forward = CheckpointedSequentialForward(module, options, groups, pack_args_as_tuple, replaced)
    return module


def uncheckpoint_module(module: nn.Module) -> bool:
    """Undo ``checkpoint_module`` / ``checkpoint_sequential_groups``; True if it was a region."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"uncheckpoint_module needs an nn.Module, got {type(module).__name__}")
    existing = checkpointed_forward_of(module)
    if existing is None:
        return False
    if existing.replaced is MISSING:
        del module.forward
    else:
        module.forward = existing.replaced
    return True
