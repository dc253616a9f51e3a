"""Keep state that a region's forward writes into out of the region.

A region's function runs twice: forward, then the recompute in backward. An argument the function
writes into keeps the first run's writes, so the recompute sees them and writes again. A Hugging
Face key/value cache (``Cache.update`` appends) is the common case: the recompute appends every key
a second time, attention attends to both copies, and the gradients come out wrong while the loss
is unchanged (torch's reentrant checkpoint has this defect; its non-reentrant one raises or
recomputes other shapes).

Hugging Face's ``GradientCheckpointingLayer`` runs checkpointed layers without a cache; every
region does the same here, whatever API created it: a cache object passed positionally or by
keyword (also inside a plain tuple, list or dict argument) becomes ``None``, a true ``use_cache``
becomes ``False``, and one warning is given per process (the same one as ``acshim.hf``'s). A
caller that expected the cache to be filled gets it back empty, as with Hugging Face. Layers that
declare ``_can_checkpoint_with_cache = True`` (cache readers) keep it.

Cache classes are recognised by name in their MRO, so transformers is never imported.
"""

from __future__ import annotations

import inspect
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

USE_CACHE_WARNING = (
    "`use_cache=True` is incompatible with gradient checkpointing. Setting `use_cache=False` "
    "(and dropping `past_key_values`) for the checkpointed blocks while training; acshim warns once.")


class _WarnOnce:
    """Process-wide "already warned" flag (resettable, for tests)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.warned = False

    def __call__(self, message: str) -> None:
        if self.warned:
            return
        if torch.compiler.is_compiling():
            # Dynamo can trace neither the lock nor warnings.warn: its graph break there, deep in a
            # model's frames, would send those frames back to eager for good. Compiled regions drop
            # the cache all the same; the warning waits for an eager region.
            return
        with self._lock:
            if self.warned:
                return
            self.warned = True
        warnings.warn(message, UserWarning, stacklevel=4)

    def reset(self) -> None:
        self.warned = False


warn_use_cache_once = _WarnOnce()

_WRITABLE_BASES = {("transformers.cache_utils", "Cache")}
"""(module, class name) of base classes whose instances a forward writes into."""

_IS_WRITABLE: dict[type, bool] = {torch.Tensor: False, torch.nn.Parameter: False, type(None): False,
                                  bool: False, int: False, float: False, str: False}


def _writable(value: Any) -> bool:
    cls = type(value)
    known = _IS_WRITABLE.get(cls)
    if known is None:
        known = _IS_WRITABLE[cls] = any((getattr(base, "__module__", ""), base.__name__) in _WRITABLE_BASES
                                        for base in cls.__mro__)
    return known


def _items(value: Any) -> list[Any] | None:
    """The members of a plain tuple, list, named tuple or dict (not other containers), else None.
    Never cached in ``_IS_WRITABLE``, whose False means "skip"."""
    cls = type(value)
    if cls is tuple or cls is list or (isinstance(value, tuple) and hasattr(value, "_fields")):
        return list(value)
    if cls is dict:
        return list(value.values())
    return None


def _contains_writable(value: Any) -> bool:
    items = _items(value)
    if items is None:
        return _writable(value)
    return any(_contains_writable(item) for item in items)


def _holds_writable(values: Any) -> bool:
    for value in values:  # a loop, not any(): this runs for every region
        if _IS_WRITABLE.get(type(value)) is not False and _contains_writable(value):
            return True
    return False


def _without_writable(value: Any) -> Any:
    items = _items(value)
    if items is None:
        return None if _writable(value) else value
    items = [_without_writable(item) for item in items]
    if type(value) is dict:
        return dict(zip(value, items))
    if type(value) is list:
        return items
    return type(value)(*items) if hasattr(value, "_fields") else tuple(items)


def region_inputs(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
                  ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` and ``kwargs`` for a checkpointed region of ``function``: unchanged (the same
    objects) unless they hold a cache, which is then dropped as described in the module docstring."""
    if not (_holds_writable(args) or (kwargs and _holds_writable(kwargs.values()))):
        return args, kwargs
    if getattr(_owner(function, args), "_can_checkpoint_with_cache", False):
        return args, kwargs
    args = tuple(_without_writable(a) for a in args)
    kwargs = {key: _without_writable(value) for key, value in kwargs.items()}
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    else:
        index = _positional_index(function, "use_cache")
        if index is not None and index < len(args) and args[index] is True:
            args = (*args[:index], False, *args[index + 1:])
    warn_use_cache_once(USE_CACHE_WARNING)
    return args, kwargs


def _owner(function: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """The module ``function`` runs: itself, its ``__self__``, a partial's, or an unbound forward's
    first argument."""
    while hasattr(function, "func") and hasattr(function, "keywords"):  # functools.partial
        args = (*function.args, *args)
        function = function.func
    if isinstance(function, torch.nn.Module):
        return function
    owner = getattr(function, "__self__", None)
    if owner is None and args and isinstance(args[0], torch.nn.Module):
        owner = args[0]
    return owner


def _positional_index(function: Callable[..., Any], name: str) -> int | None:
    if isinstance(function, torch.nn.Module):
        function = function.forward
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return None
    for index, parameter in enumerate(parameters):
        if parameter.kind not in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
            return None
        if parameter.name == name:
            return index
    return None
