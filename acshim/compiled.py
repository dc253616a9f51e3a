"""Regions under ``torch.compile``: what a region becomes while Dynamo traces it.

Dynamo captures ``torch.utils.checkpoint.checkpoint`` as a higher-order operator; AOTAutograd then
recomputes the region's operators in the compiled backward. It cannot trace acshim's eager
machinery (a callable with side effects, our reentrant ``autograd.Function``, Python-side RNG
tracker restores, ``saved_tensors_hooks`` storage tiers, lifecycle observers). So while compiling:

- a region that needs only what the operator supports (full recompute, kwargs, nested and
  non-tensor outputs, a selective-op ``context_fn``, reentrant or not: in a compiled graph both
  give the same gradients) becomes ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``.
  Dropout stays exact because the compiled graph keeps its random masks; BatchNorm statistics are
  updated once by the compiled forward.
- a region that needs more (a storage tier, an observer, live RNG tracker streams) is left out of
  the graph: Dynamo breaks the graph around it and it runs eagerly, with every acshim semantic,
  while the code before and after it still compiles. Under ``fullgraph=True`` Dynamo raises.

Inside a compiled region ``is_checkpointing()`` and ``is_recomputing()`` stay False: the compiled
backward recomputes operators, never Python code.

This module sits below ``acshim.region``: the eager region it falls back to is handed in
(``run_traced(..., eager=acshim.region.run_region)``), and the callable it hands torch's
checkpoint builds on ``acshim.region_call``, so nothing here imports ``acshim.region``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

from . import rng
from .options import RegionOptions
from .region_call import RegionCall


def is_compiling() -> bool:
    """True while Dynamo (or export) traces the caller."""
    return torch.compiler.is_compiling()


def compiled_graphs() -> int:
    """Graphs Dynamo compiled in this process so far (0 without importing Dynamo when nothing did)."""
    dynamo_utils = sys.modules.get("torch._dynamo.utils")
    counters = getattr(dynamo_utils, "counters", None)
    return int(counters["stats"]["unique_graphs"]) if counters else 0


def needs_eager(options: RegionOptions) -> str | None:
    """Why a region cannot be traced as a checkpoint operator (None when it can)."""
    if options.saved_tensors_scope is not None:
        return "a storage tier (saved_tensors_scope / offload)"
    if options.observer is not None:
        return "a lifecycle observer"
    if options.preserve_rng_state and rng.has_streams():
        return "live RNG tracker streams"
    return None


EagerRegion = Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any], RegionOptions], Any]
"""How the eager engine runs a region: ``acshim.region.run_region``'s signature."""


def run_traced(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
               options: RegionOptions, *, eager: EagerRegion) -> Any:
    """The region as Dynamo should see it: torch's checkpoint operator, or a graph break around
    ``eager(function, args, kwargs, options)`` (the eager region, ``acshim.region.run_region``)."""
    why = needs_eager(options)
    if why is not None:
        entry = _eager_entries.get((why, eager))
        if entry is None:  # first time: Dynamo breaks the graph here, on torch.compiler.disable
            entry = _eager_entries[(why, eager)] = torch.compiler.disable(
                eager, recursive=True,
                reason=f"acshim: a region with {why} runs eagerly (a graph break); under fullgraph=True "
                       "drop that option or checkpoint this region with torch.utils.checkpoint")
        return entry(function, args, kwargs, options)
    extra: dict[str, Any] = {}
    if options.context_fn is not None:
        # Dynamo accepts a plain function or a partial as context_fn, not an attribute it reads lazily
        extra["context_fn"] = functools.partial(options.context_fn)
    # Dynamo captures as its checkpoint operator whatever torch.utils.checkpoint.checkpoint is now
    # (torch._dynamo.utils.is_utils_checkpoint compares identity): torch's own, or acshim's routed one
    return torch_checkpoint.checkpoint(
        TracedCall(function, options), *args, use_reentrant=False,
        preserve_rng_state=options.preserve_rng_state, **extra, **kwargs)


_eager_entries: dict[tuple[str, EagerRegion], Callable[..., Any]] = {}
"""Per reason (and eager region function), the eager region behind ``torch.compiler.disable``
(made on first use: creating it imports Dynamo, which plain eager users never pay for). A cache
of wrappers around module-level functions: nothing in it refers to a user's object."""


class TracedCall:
    """The callable handed to torch's checkpoint while compiling. Traced, it is the bare function
    (no side effects, which the operator forbids). If Dynamo gives up on the operator, it runs the
    checkpoint call eagerly: then this becomes the eager region's callable, so the region still
    restores tracker RNG streams, keeps BatchNorm statistics once and sets the region flags."""

    def __init__(self, function: Callable[..., Any], options: RegionOptions) -> None:
        self.function = function
        self.options = options
        self.eager: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return self.function(*args, **kwargs)
        if self.eager is None:
            self.eager = RegionCall(self.function, self.options)
        return self.eager(*args, **kwargs)
