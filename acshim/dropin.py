"""``acshim.checkpoint``: a drop-in for ``torch.utils.checkpoint.checkpoint`` on the engine.

Same keywords and errors as torch (torch/utils/checkpoint.py). One deliberate difference:
``use_reentrant`` defaults to False (torch warns and falls back to True, pytorch#160534).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

from .options import DETERMINISM_CHECKS, RegionOptions
from .region import run_region
from .region_dialect import claim, release

noop_context_fn = torch_checkpoint.noop_context_fn


def checkpoint(
    function: Callable[..., Any],
    *args: Any,
    use_reentrant: bool | None = None,
    context_fn: Callable[[], tuple[AbstractContextManager[Any], AbstractContextManager[Any]]] = noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    preserve_rng_state: bool = True,
    **kwargs: Any,
) -> Any:
    """Run ``function(*args, **kwargs)`` without keeping its activations; recompute them in backward.

    Args mirror ``torch.utils.checkpoint.checkpoint``: ``use_reentrant`` (default False here),
    ``preserve_rng_state`` (restore CPU/device/tracker RNG for the recompute), ``context_fn``
    (forward/recompute contexts, e.g. selective-op policies), ``determinism_check``
    (``"default"`` or ``"none"``), ``debug`` and ``early_stop``. Keyword arguments other than these
    are passed to ``function`` (non-reentrant only). Nested containers, dataclasses and
    ``ModelOutput`` are accepted as inputs and returned unchanged in structure, in both modes.
    """
    if not callable(function):
        raise TypeError(f"checkpoint() needs a callable as its first argument, got {type(function).__name__}")
    reentrant = bool(use_reentrant)
    if reentrant:
        if kwargs:
            raise ValueError(
                f"Unexpected keyword arguments: {','.join(kwargs)}. With use_reentrant=True only "
                "positional arguments reach the function: pass them positionally, or use use_reentrant=False.")
        if context_fn is not noop_context_fn or debug:
            raise ValueError("Passing context_fn or debug is only supported when use_reentrant=False.")
    if determinism_check not in DETERMINISM_CHECKS:
        raise ValueError(
            f"determinism_check should be one of {list(DETERMINISM_CHECKS)}, but got {determinism_check}")
    if not isinstance(preserve_rng_state, bool):
        raise TypeError(f"preserve_rng_state must be True or False, got {preserve_rng_state!r}")
    # the API that made the region: the facade's that called (region_dialect.made_by), else "acshim";
    # while Dynamo traces, none (no report or plan sees a traced region)
    dialect, token = (None, None) if torch.compiler.is_compiling() else claim()
    try:
        options = RegionOptions(
            reentrant=reentrant,
            preserve_rng_state=preserve_rng_state,
            determinism_check=determinism_check,
            debug=debug,
            early_stop=early_stop,
            context_fn=None if context_fn is noop_context_fn else context_fn,
            dialect=dialect,
        )
        return run_region(function, args, kwargs, options)
    finally:
        if token is not None:
            release(token)
