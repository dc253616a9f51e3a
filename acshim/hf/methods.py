"""Carry out transformers' own checkpointing switches with the engine.

Replaces, on ``PreTrainedModel``, ``gradient_checkpointing_enable`` / ``_disable`` (transformers
4.x and 5.x) and ``activation_checkpointing_enable`` / ``_disable`` (late 5.x), as plain functions
that call the upstream ones. Upstream keeps its bookkeeping (flags, ``is_gradient_checkpointing``,
input-grad hooks, deprecation warnings, override dispatch); acshim then installs
``EngineCheckpointFunction`` as every ``_gradient_checkpointing_func`` and applies
``every_n_layers`` itself (also on 4.x, where upstream has no such argument). Deliberate
differences, each "better" in the compat matrix:

- ``every_n_layers`` / ``offload`` are also accepted inside the kwargs dict (4.x Trainer passes
  ``gradient_checkpointing_kwargs`` through unchanged) and ``offload`` never fails on CPU.
- A later call with nothing but defaults (Trainer's ``gradient_checkpointing=True`` without kwargs)
  keeps the settings the user gave this model explicitly (huggingface/transformers#26221).
- A model upstream refuses (``supports_gradient_checkpointing = False`` or no module with a
  ``gradient_checkpointing`` flag) is checkpointed in place when its blocks can be found.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..options import RegionOptions
from .blocks import gradient_checkpointing_layer_class, hf_blocks
from .models import checkpoint_model, uncheckpoint_model
from .offload import with_offload
from .patches import AttributePatch, PatchSet
from .region import SKIP_ATTRIBUTE, EngineCheckpointFunction, options_from_checkpoint_kwargs

logger = logging.getLogger("acshim.hf")

ENABLE_NAMES = ("gradient_checkpointing_enable", "activation_checkpointing_enable")
DISABLE_NAMES = ("gradient_checkpointing_disable", "activation_checkpointing_disable")
ROOT_FLAG_ADDED = "_acshim_hf_root_flag"


@dataclass(frozen=True)
class Settings:
    """What a model's checkpointing was last enabled with."""

    kwargs: dict[str, Any] | None
    every_n_layers: int
    offload: bool
    explicit: bool
    in_place: bool = False


_settings: weakref.WeakKeyDictionary[nn.Module, Settings] = weakref.WeakKeyDictionary()
_busy = threading.local()  # ids of models inside an outermost enable/disable call on this thread
_patches = PatchSet()


def settings_of(model: nn.Module) -> Settings | None:
    """The settings acshim enabled ``model``'s checkpointing with, or None."""
    return _settings.get(model)


def _transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def _resolve(model: nn.Module, kwargs: dict[str, Any] | None, every_n_layers: int, offload: bool) -> Settings:
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"gradient_checkpointing_kwargs must be a dict or None, got {type(kwargs).__name__}")
    rest = None if kwargs is None else dict(kwargs)
    if rest is not None:
        every_n_layers = rest.pop("every_n_layers", every_n_layers)
        offload = rest.pop("offload", offload)
    if not isinstance(every_n_layers, int) or isinstance(every_n_layers, bool) or every_n_layers < 1:
        raise ValueError(f"every_n_layers must be a whole number >= 1, got {every_n_layers!r}")
    explicit = kwargs is not None or every_n_layers != 1 or bool(offload)
    previous = _settings.get(model)
    if not explicit and previous is not None and previous.explicit:
        logger.info("acshim: %s checkpointing was enabled with %s; a later call with default arguments "
                    "(e.g. Trainer's gradient_checkpointing=True) keeps them (transformers#26221)",
                    type(model).__name__, previous)
        return previous
    return Settings(rest, every_n_layers, bool(offload), explicit)


def _options(settings: Settings) -> RegionOptions:
    # transformers' default when no kwargs are given: reentrant in 4.x, non-reentrant from 5.0.
    # A dict without use_reentrant gets the engine's default (non-reentrant, no warning).
    default_reentrant = settings.kwargs is None and _transformers_major() < 5
    options = options_from_checkpoint_kwargs(settings.kwargs, default_reentrant)
    return with_offload(options, settings.offload)


def _upstream_supports(model: nn.Module) -> bool:
    return bool(getattr(model, "supports_gradient_checkpointing", False)) and any(
        hasattr(module, "gradient_checkpointing") for module in model.modules())


def _select_layers(model: nn.Module, every_n_layers: int) -> None:
    """Flag blocks 0, n, 2n... for checkpointing; mark the others for ``EngineCheckpointFunction``
    to skip where a model-level loop (not the layer) makes the checkpoint call."""
    layer_class = gradient_checkpointing_layer_class()
    for index, (_, block) in enumerate(hf_blocks(model)):
        chosen = index % every_n_layers == 0
        if (layer_class is not None and isinstance(block, layer_class)) or hasattr(block, "gradient_checkpointing"):
            block.gradient_checkpointing = chosen
        if chosen:
            block.__dict__.pop(SKIP_ATTRIBUTE, None)
        else:
            setattr(block, SKIP_ATTRIBUTE, True)


def _clear_marks(model: nn.Module) -> None:
    for module in model.modules():
        module.__dict__.pop(SKIP_ATTRIBUTE, None)
    if model.__dict__.pop(ROOT_FLAG_ADDED, False):
        model.__dict__.pop("gradient_checkpointing", None)


def _enable(model: nn.Module, original: Callable[..., Any], kwargs: dict[str, Any] | None,
            every_n_layers: int, offload: bool) -> None:
    settings = _resolve(model, kwargs, every_n_layers, offload)
    options = _options(settings)
    uncheckpoint_model(model)  # regions from auto-patching give way to the explicit switch
    _clear_marks(model)
    if not _upstream_supports(model):
        if not checkpoint_model(model, every_n_layers=settings.every_n_layers, options=options):
            original(model, {"use_reentrant": options.reentrant})  # raises upstream's ValueError
            return
        if not hasattr(model, "gradient_checkpointing"):
            model.gradient_checkpointing = True  # so is_gradient_checkpointing reports it
            model.__dict__[ROOT_FLAG_ADDED] = True
        _settings[model] = Settings(settings.kwargs, settings.every_n_layers, settings.offload,
                                    settings.explicit, in_place=True)
        return
    # Upstream does the bookkeeping; only torch-valid keywords reach it, and no offload (its
    # save_on_cpu(pin_memory=True) fails on CPU-only machines): the engine does that part.
    original(model, {"use_reentrant": options.reentrant})
    function = EngineCheckpointFunction(options)
    for module in model.modules():
        if hasattr(module, "gradient_checkpointing"):
            module._gradient_checkpointing_func = function
    _select_layers(model, settings.every_n_layers)
    _settings[model] = settings


def _disable(model: nn.Module, original: Callable[..., Any]) -> None:
    original(model)
    uncheckpoint_model(model)
    _clear_marks(model)
    _settings.pop(model, None)


def _outermost(model: nn.Module) -> bool:
    busy = getattr(_busy, "ids", None)
    if busy is None:
        busy = _busy.ids = set()
    return id(model) not in busy


class _Busy:
    def __init__(self, model: nn.Module) -> None:
        self.key = id(model)

    def __enter__(self) -> None:
        _busy.ids.add(self.key)

    def __exit__(self, *exc: Any) -> None:
        _busy.ids.discard(self.key)


def _make_enable(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    if name == "gradient_checkpointing_enable":
        def enable(self: nn.Module, gradient_checkpointing_kwargs: dict[str, Any] | None = None,
                   **kwargs: Any) -> None:
            if not _outermost(self):
                return original(self, gradient_checkpointing_kwargs, **kwargs)
            with _Busy(self):
                _enable(self, lambda m, kw: original(m, kw), gradient_checkpointing_kwargs,
                        kwargs.pop("every_n_layers", 1), kwargs.pop("offload", False))
    else:
        def enable(self: nn.Module, activation_checkpointing_kwargs: dict[str, Any] | None = None,
                   every_n_layers: int = 1, offload: bool = False) -> None:
            if not _outermost(self):
                return original(self, activation_checkpointing_kwargs, every_n_layers, offload)
            with _Busy(self):
                _enable(self, lambda m, kw: original(m, kw), activation_checkpointing_kwargs, every_n_layers, offload)
    enable.__name__ = enable.__qualname__ = name
    enable.__doc__ = (original.__doc__ or "") + "\n\n(acshim: carried out by the acshim engine.)"
    enable.__wrapped__ = original  # type: ignore[attr-defined]
    return enable


def _make_disable(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def disable(self: nn.Module) -> None:
        if not _outermost(self):
            return original(self)
        with _Busy(self):
            _disable(self, original)

    disable.__name__ = disable.__qualname__ = name
    disable.__doc__ = original.__doc__
    disable.__wrapped__ = original  # type: ignore[attr-defined]
    return disable


def patch_methods() -> None:
    """Replace the enable/disable entry points on ``PreTrainedModel`` (idempotent)."""
    if _patches:
        return
    from transformers.modeling_utils import PreTrainedModel

    patches = []
    for name in ENABLE_NAMES + DISABLE_NAMES:
        original = vars(PreTrainedModel).get(name)
        if original is None:  # activation_checkpointing_* only exist in late 5.x
            continue
        factory = _make_enable if name in ENABLE_NAMES else _make_disable
        patches.append(AttributePatch(PreTrainedModel, name, factory(name, original)))
    _patches.apply(patches)


def unpatch_methods() -> None:
    """Put the upstream entry points back exactly."""
    _patches.restore()


def methods_patched() -> bool:
    return bool(_patches)
