"""Keep key/value caches out of checkpointed Hugging Face blocks during training.

A cache object is written during forward (``DynamicCache.update``, T5's ``EncoderDecoderCache``
marking cross-attention as computed), so a recompute either writes it twice or reads what the
first forward left there: with reentrant recompute, T5 reuses cross-attention keys computed under
``no_grad`` and gradients come out wrong. Upstream ``GradientCheckpointingLayer`` (transformers
``modeling_layers.py``) therefore sets ``use_cache=False`` and drops ``past_key_values`` /
``layer_past`` (``past_key_value`` in 4.x) when it checkpoints in training; acshim does the same
for every block it checkpoints, and also turns ``use_cache`` off at the model's entry so 4.x models
(whose layer outputs change shape with ``use_cache``) and 5.x models (which build an empty cache
object) stay consistent.

Deliberate difference: upstream logs one warning per layer class and also warns when the cache is
only on by the config's default; acshim warns once per process, and only when the caller asked for
the cache (``use_cache=True`` or a ``past_key_values`` object) - the config default is turned off
silently (huggingface/trl#3891 forces ``use_cache=False`` just to silence that warning).
The warning is shared with ``acshim.region_state``, which does the same inside every engine region
whatever API created it.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from ..region_state import USE_CACHE_WARNING, warn_use_cache_once
from ..state import state

CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past")


def checkpointing_active(module: nn.Module) -> bool:
    """True when a region around ``module`` would really checkpoint: training, grad on, not disabled.

    Upstream checkpoints only ``if self.gradient_checkpointing and self.training``; evaluation with
    grad enabled (saliency maps, ``torch.autograd.grad`` probes) runs plainly, as upstream.
    """
    return module.training and torch.is_grad_enabled() and not state.is_checkpointing_disabled


def drop_cache_kwargs(module: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` for a checkpointed block with caching turned off (warns once if the caller asked
    for a cache). Layers declaring ``_can_checkpoint_with_cache = True`` (cache readers, transformers
    5.x) keep their ``past_key_values``."""
    changed = False
    if kwargs.get("use_cache"):
        kwargs = {**kwargs, "use_cache": False}
        changed = True
    if not getattr(module, "_can_checkpoint_with_cache", False):
        for name in CACHE_KWARGS:
            if kwargs.get(name) is not None:
                kwargs = {**kwargs, name: None}
                changed = True
    if changed:
        warn_use_cache_once(USE_CACHE_WARNING)
    return kwargs


_ACCEPTS_USE_CACHE: dict[type, bool] = {}


def _accepts_use_cache(model: nn.Module) -> bool:
    cls = type(model)
    if cls not in _ACCEPTS_USE_CACHE:
        try:
            _ACCEPTS_USE_CACHE[cls] = "use_cache" in inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            _ACCEPTS_USE_CACHE[cls] = False
    return _ACCEPTS_USE_CACHE[cls]


def turn_off_cache_in_training(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Forward pre-hook (``with_kwargs=True``) on a model whose blocks acshim checkpoints.

    A module-level function so a hooked model deep-copies and pickles; found again by identity
    when the hook is removed.
    """
    if not checkpointing_active(model) or not _accepts_use_cache(model):
        return None
    requested = kwargs.get("use_cache")
    if requested is None:
        config = getattr(model, "config", None)
        if not getattr(config, "use_cache", False):
            return None
    elif not requested:
        return None
    else:
        warn_use_cache_once(USE_CACHE_WARNING)
    return args, {**kwargs, "use_cache": False}


def add_cache_hook(model: nn.Module) -> None:
    """Register ``turn_off_cache_in_training`` on ``model`` once."""
    if not any(hook is turn_off_cache_in_training for hook in model._forward_pre_hooks.values()):
        model.register_forward_pre_hook(turn_off_cache_in_training, with_kwargs=True)


def remove_cache_hooks(model: nn.Module) -> None:
    """Remove ``turn_off_cache_in_training`` from ``model`` and its submodules."""
    for module in model.modules():
        for key, hook in list(module._forward_pre_hooks.items()):
            if hook is turn_off_cache_in_training:
                del module._forward_pre_hooks[key]
                module._forward_pre_hooks_with_kwargs.pop(key, None)
