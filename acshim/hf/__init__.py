"""Hugging Face transformers and Accelerate on the acshim engine.

- ``patch_transformers(**options)``: every ``PreTrainedModel`` built afterwards (``from_pretrained``,
  ``from_config``, direct construction) has its repeated blocks checkpointed by the engine, in
  place, with no code change in the script (``acshim run --hf``).
- ``install()`` / ``uninstall()`` (called by ``acshim.install()`` and ``acshim run``): the switches
  scripts already use - ``gradient_checkpointing_enable``, ``activation_checkpointing_enable``,
  their ``_disable`` twins, Trainer's ``gradient_checkpointing`` / ``activation_checkpointing``
  arguments, Accelerate's FSDP ``activation_checkpointing`` - are carried out by the engine.

Patches are applied when ``transformers.modeling_utils`` / ``accelerate.accelerator`` is imported
(at once if it already is), and undone exactly.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..apply import build_options
from ..options import RegionOptions
from ..policy import PolicyLike
from .accelerate_ac import fsdp2_apply_ac, patch_accelerate, unpatch_accelerate
from .blocks import HFBlocks, hf_blocks
from .caching import USE_CACHE_WARNING
from .methods import patch_methods, settings_of, unpatch_methods
from .models import acshim_regions, checkpoint_model, uncheckpoint_model, upstream_checkpointing_on
from .patches import AttributePatch, PatchSet
from .region import EngineCheckpointFunction

__all__ = [
    "EngineCheckpointFunction", "HFBlocks", "USE_CACHE_WARNING", "acshim_regions", "checkpoint_model",
    "fsdp2_apply_ac", "hf_blocks", "install", "installed", "patch_transformers", "settings_of",
    "uncheckpoint_model", "uninstall", "unpatch_transformers",
]

TRANSFORMERS_MODULE = "transformers.modeling_utils"
ACCELERATE_MODULE = "accelerate.accelerator"


@dataclass
class _AutoPatch:
    policy: PolicyLike
    every_n_layers: int
    offload: bool
    options: RegionOptions


@dataclass
class _State:
    installed: bool = False
    autopatch: _AutoPatch | None = None
    post_init: PatchSet = field(default_factory=PatchSet)
    hooks_registered: set[str] = field(default_factory=set)


_state = _State()


def installed() -> bool:
    """True between ``install()`` and ``uninstall()``."""
    return _state.installed


def _routing_wanted() -> bool:
    return _state.installed or _state.autopatch is not None


def _on_transformers(module: Any = None) -> None:
    if _routing_wanted():
        patch_methods()
        if _state.autopatch is not None:
            _patch_post_init()


def _on_accelerate(module: Any = None) -> None:
    if _routing_wanted():
        patch_accelerate()


def _register_import_hooks() -> None:
    import wrapt

    for name, callback in ((TRANSFORMERS_MODULE, _on_transformers), (ACCELERATE_MODULE, _on_accelerate)):
        if name not in _state.hooks_registered:
            _state.hooks_registered.add(name)
            wrapt.register_post_import_hook(callback, name)  # runs at once if already imported


def _sync() -> None:
    if _routing_wanted():
        _register_import_hooks()
        if TRANSFORMERS_MODULE in sys.modules:
            _on_transformers()
        if ACCELERATE_MODULE in sys.modules:
            _on_accelerate()
    else:
        unpatch_methods()
        unpatch_accelerate()
    if _state.autopatch is None:
        _state.post_init.restore()


def install() -> None:
    """Route transformers' and Accelerate's checkpointing switches to the engine (idempotent).
    Does not import transformers: patches apply when the script imports it."""
    _state.installed = True
    _sync()


def uninstall() -> None:
    """Undo ``install()`` (auto-patching, if on, keeps the routing until ``unpatch_transformers``)."""
    _state.installed = False
    _sync()


# --------------------------------------------------------------------------------------------------
# auto-patching


def _autopatch_model(model: nn.Module) -> None:
    settings = _state.autopatch
    if settings is None or upstream_checkpointing_on(model) or settings_of(model) is not None:
        return  # the model's own switch (legacy config.gradient_checkpointing) already decided
    checkpoint_model(model, settings.policy, every_n_layers=settings.every_n_layers, offload=settings.offload,
                     options=settings.options)


def _patch_post_init() -> None:
    if _state.post_init:
        return
    from transformers.modeling_utils import PreTrainedModel

    original = vars(PreTrainedModel)["post_init"]

    def post_init(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        _autopatch_model(self)
        return result

    post_init.__name__ = post_init.__qualname__ = "post_init"
    post_init.__doc__ = original.__doc__
    post_init.__wrapped__ = original  # type: ignore[attr-defined]
    _state.post_init.apply([AttributePatch(PreTrainedModel, "post_init", post_init)])


def patch_transformers(policy: PolicyLike = None, *, every_n_layers: int = 1, offload: bool = False,
                       options: RegionOptions | None = None, **option_changes: Any) -> None:
    """Checkpoint the repeated blocks of every transformers model created from now on.

    Same options as ``acshim.apply_checkpointing``: ``policy`` (default ``HFBlocks()``: the
    ``GradientCheckpointingLayer`` blocks, else ``_no_split_modules``, else the largest set of
    identical blocks), ``every_n_layers`` (blocks 0, n, 2n...), ``offload`` (storage tier), and
    ``RegionOptions`` fields as keywords (``reentrant=True``, ``preserve_rng_state``...). Models whose
    class declares no checkpointing support are checkpointed too. Calling again changes the options
    for later models. While on, ``gradient_checkpointing_enable`` & co. are also carried out by the
    engine (an explicit call replaces the auto-patch settings on that model).

    >>> acshim.patch_transformers(every_n_layers=2)
    >>> model = AutoModelForCausalLM.from_config(config)   # blocks 0, 2, 4... are engine regions
    """
    try:
        import transformers.modeling_utils  # noqa: F401
    except ImportError as error:
        raise ImportError("acshim.patch_transformers needs transformers: pip install 'acshim[hf]'") from error
    region_options = build_options(options, **option_changes)
    if not isinstance(every_n_layers, int) or isinstance(every_n_layers, bool) or every_n_layers < 1:
        raise ValueError(f"every_n_layers must be a whole number >= 1, got {every_n_layers!r}")
    if not isinstance(offload, bool):
        raise TypeError(f"offload must be True or False, got {offload!r}")
    _state.autopatch = _AutoPatch(policy, every_n_layers, bool(offload), region_options)
    _sync()


def unpatch_transformers() -> None:
    """Stop checkpointing new models (models already built keep their regions; remove them with
    ``acshim.hf.uncheckpoint_model(model)`` or ``model.gradient_checkpointing_disable()``)."""
    _state.autopatch = None
    _sync()
