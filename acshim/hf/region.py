"""The engine behind Hugging Face's checkpointing switches.

Two ways a transformers block becomes an engine region:

- ``HFBlockForward``: installed in place as a block's ``forward`` (auto-patching, Accelerate's FSDP
  activation checkpointing, models upstream refuses). Caching is turned off inside, as upstream's
  ``GradientCheckpointingLayer`` does; module hooks stay outside the region.
- ``EngineCheckpointFunction``: installed as ``_gradient_checkpointing_func`` when a script calls
  ``gradient_checkpointing_enable`` / ``activation_checkpointing_enable``, keeping upstream's own
  bookkeeping. Calling convention ``func(function, *positional_args)`` as upstream; a
  ``functools.partial``'s keywords are lifted into the region's inputs, so a tensor passed by
  keyword (``hidden_states=``) gets its gradient even in reentrant mode, where upstream's closure
  would silently drop it.
"""

from __future__ import annotations

import functools
import inspect
import logging
import types
from collections.abc import Callable
from typing import Any

from torch import nn

from ..apply import build_options
from ..options import DETERMINISM_CHECKS, RegionOptions
from ..region import run_region
from ..state import state
from ..wrap import CheckpointedForward, checkpoint_module, checkpointed_forward_of
from .caching import checkpointing_active, drop_cache_kwargs

SKIP_ATTRIBUTE = "_acshim_hf_skip_checkpoint"
"""Set True on a block that ``every_n_layers`` leaves out, for models whose layer loop (not the
layer) calls ``_gradient_checkpointing_func`` (transformers before ``GradientCheckpointingLayer``)."""

# torch.utils.checkpoint keywords and the RegionOptions field each one sets.
_TORCH_CHECKPOINT_KEYWORDS = {
    "use_reentrant": "reentrant",
    "preserve_rng_state": "preserve_rng_state",
    "determinism_check": "determinism_check",
    "debug": "debug",
    "early_stop": "early_stop",
    "context_fn": "context_fn",
}


DIALECT = "hf"
"""How ``acshim run --report`` and the ``--budget`` plan name the regions made here (``patch_transformers``,
``--hf``, ``gradient_checkpointing_enable`` on the engine, Accelerate's activation checkpointing)."""


def named_hf(options: RegionOptions) -> RegionOptions:
    """``options`` naming ``DIALECT`` as the API that made the region, unless they name one already."""
    return options if options.dialect is not None else options.replace(dialect=DIALECT)


def options_from_checkpoint_kwargs(kwargs: dict[str, Any] | None, default_reentrant: bool,
                                   base: RegionOptions | None = None, argument: str = "gradient_checkpointing_kwargs"
                                   ) -> RegionOptions:
    """Translate Hugging Face ``gradient_checkpointing_kwargs`` (torch checkpoint keywords, or
    acshim ``RegionOptions`` field names) into engine options.

    ``default_reentrant`` applies when ``use_reentrant`` is absent. Unknown keys raise at enable
    time (upstream would pass them on to each block's ``forward`` at the first training step).
    """
    changes: dict[str, Any] = {}
    for key, value in dict(kwargs or {}).items():
        field = _TORCH_CHECKPOINT_KEYWORDS.get(key, key)
        if field in changes:
            raise ValueError(f"{argument}: {key!r} given twice (as a torch keyword and as an acshim option)")
        changes[field] = value
    if changes.get("reentrant") is None:
        changes["reentrant"] = default_reentrant
    changes["reentrant"] = bool(changes["reentrant"])
    if changes.get("determinism_check", "default") not in DETERMINISM_CHECKS:
        raise ValueError(f"determinism_check should be one of {list(DETERMINISM_CHECKS)}, "
                         f"but got {changes['determinism_check']}")
    if changes["reentrant"] and (changes.get("context_fn") is not None or changes.get("debug")):
        raise ValueError("Passing context_fn or debug is only supported when use_reentrant=False.")
    try:
        return build_options(base, **changes)
    except TypeError as error:
        raise TypeError(f"{argument}: {error}") from None


class HFBlockForward(CheckpointedForward):
    """A transformers block's in-place region forward: plain in eval / no-grad / when the block's
    own upstream checkpointing is switched on (no double recompute); otherwise caching off, then
    the engine region."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        forward = self.plain_forward()
        if not checkpointing_active(module) or getattr(module, "gradient_checkpointing", False) is True \
                or _inside_another_region():
            return forward(*args, **kwargs)
        return run_region(forward, args, drop_cache_kwargs(module, kwargs), self.options)

    def __deepcopy__(self, memo: dict[int, Any]) -> HFBlockForward:
        base = super().__deepcopy__(memo)
        return HFBlockForward(base.module, base.options, base.replaced)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_as_hf_forward, super().__reduce__())


def _as_hf_forward(restore: Callable[..., CheckpointedForward], args: tuple[Any, ...]) -> HFBlockForward:
    base = restore(*args)
    return HFBlockForward(base.module, base.options, base.replaced)


def checkpoint_hf_block(module: nn.Module, options: RegionOptions) -> nn.Module:
    """Make ``module`` an in-place engine region with ``HFBlockForward`` (idempotent)."""
    checkpoint_module(module, options)
    base = checkpointed_forward_of(module)
    assert base is not None
    module.forward = HFBlockForward(module, options, base.replaced)
    return module


def _unwrap(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
            ) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    """The region's callable and inputs, partials lifted. An unbound forward given its block as
    first argument (transformers 5.x: ``partial(forward, self, **kwargs)``) comes back bound to the
    block, so the engine knows which module the region runs: a reentrant region then hands that
    module's parameters to autograd as inputs (their gradient reaches them once, from the outer
    graph: DDP's hooks fire once), and reports and plans name the block (not the shared forward)."""
    while isinstance(function, functools.partial):
        args = function.args + args
        kwargs = {**function.keywords, **kwargs}
        function = function.func
    if args and isinstance(args[0], nn.Module) and inspect.isfunction(function):  # f(m, x) is m-bound f(x)
        function, args = types.MethodType(function, args[0]), args[1:]
    return function, args, kwargs


def _owner(function: Callable[..., Any]) -> nn.Module | None:
    """The block a checkpoint call runs: ``layer.__call__`` (4.x loops), ``partial(super().__call__)``
    (4.5x layer class) or ``partial(forward, layer)`` (5.x layer class)."""
    while isinstance(function, functools.partial):
        if function.args and isinstance(function.args[0], nn.Module) and not inspect.ismethod(function.func):
            return function.args[0]
        function = function.func
    owner = getattr(function, "__self__", None)
    return owner if isinstance(owner, nn.Module) else None


def _inside_another_region() -> bool:
    """Whether a region (another dialect's wrapper around this block: torch's or Accelerate's
    activation checkpointing on top of ``gradient_checkpointing_enable()``) is running its forward
    or recompute. The block then runs plainly inside it: one region per block, so each block is
    recomputed once, not twice (a nested region recomputes again in the outer one's backward)."""
    if not (state.is_checkpointing or state.is_recomputing):
        return False
    _log_double_wrapping_once()
    return True


@functools.cache
def _log_double_wrapping_once() -> None:
    logging.getLogger("acshim").info(
        "acshim: Hugging Face gradient checkpointing runs inside another checkpoint wrapper of the same blocks "
        "(e.g. Accelerate's FSDP activation_checkpointing or apply_activation_checkpointing); keeping the outer "
        "region only, so each block is recomputed once")


class EngineCheckpointFunction:
    """A ``_gradient_checkpointing_func`` that runs the engine with fixed ``options``."""

    def __init__(self, options: RegionOptions) -> None:
        self.options = named_hf(options)

    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        owner = _owner(function)
        if owner is not None and getattr(owner, SKIP_ATTRIBUTE, False) or _inside_another_region():
            return function(*args, **kwargs)
        target, args, kwargs = _unwrap(function, args, kwargs)
        return run_region(target, args, kwargs, self.options)

    def __repr__(self) -> str:
        return f"EngineCheckpointFunction({self.options!r})"
