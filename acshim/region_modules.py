"""The modules a region's callable runs, found without running it.

A region must know which modules its forward may touch: their buffers are kept as the forward saw
them for the recompute (``acshim.region_buffers``) and, in reentrant regions, their parameters are
replaced by aliases during the recompute (``acshim.region_aliases``). They are found from the
callable and its arguments, never by module type:

- a module (``checkpoint(block, x)``), a bound method's ``__self__`` (``block.forward``, Hugging
  Face's ``partial(layer.__call__, **kwargs)``), a ``functools.partial``'s function and arguments;
- for a plain function or lambda: the modules in its closure cells and in the globals its code
  names (``lambda t: lin1(t)``, Megatron's ``custom(start, end)`` closure over the model), looking
  one level into functions, partials and lists found there;
- module arguments of the call (``checkpoint(run, adapter, x)``).

Each found module stands for itself and its submodules. A callable whose modules are found nowhere
(a callable object holding them in a private container, say) gets none: the caller then watches
which modules run (``region_buffers.watch_modules``). Tensors found the same way (a closure's
weight) are reported too: a reentrant region aliases them during its recompute.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

_DEPTH = 3
"""How deep nested functions (a closure capturing a closure, HF's ``create_custom_forward``) are
followed: enough for the wrappers libraries write, bounded so a huge object graph is never walked."""


def region_modules(function: Callable[..., Any], args: Iterable[Any] = (),
                   kwargs: dict[str, Any] | None = None, tensors: dict[int, torch.Tensor] | None = None
                   ) -> list[nn.Module]:
    """Every module ``function(*args, **kwargs)`` can be seen to run (roots and their submodules,
    each once, in a stable order); empty when none is found. Tensors the callable references
    directly are added to ``tensors`` (by id) when given."""
    roots: dict[int, nn.Module] = {}
    _from_callable(function, roots, 0, tensors)
    for value in args:
        if isinstance(value, nn.Module):
            roots.setdefault(id(value), value)
    if kwargs:
        for value in kwargs.values():
            if isinstance(value, nn.Module):
                roots.setdefault(id(value), value)
    if len(roots) == 1:
        return list(next(iter(roots.values())).modules())
    seen: set[int] = set()
    found: list[nn.Module] = []
    for root in roots.values():
        for module in root.modules():
            if id(module) not in seen:
                seen.add(id(module))
                found.append(module)
    return found


Found = dict[int, torch.Tensor] | None


def _from_callable(function: Any, roots: dict[int, nn.Module], depth: int, tensors: Found) -> None:
    while isinstance(function, functools.partial):
        for value in (*function.args, *function.keywords.values()):
            _from_value(value, roots, depth + 1, tensors)
        function = function.func
    if isinstance(function, nn.Module):
        roots.setdefault(id(function), function)
        return
    owner = getattr(function, "__self__", None)
    if isinstance(owner, nn.Module):
        roots.setdefault(id(owner), owner)
        return
    if isinstance(function, types.MethodType):
        function = function.__func__
    code = getattr(function, "__code__", None)
    if code is None:
        return
    for cell in getattr(function, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # a cell not filled yet
            continue
        _from_value(value, roots, depth + 1, tensors)
    names = getattr(function, "__globals__", None)
    if names:
        for name in code.co_names:
            value = names.get(name)
            if value is not None:
                _from_value(value, roots, depth + 1, tensors)


def _from_value(value: Any, roots: dict[int, nn.Module], depth: int, tensors: Found) -> None:
    if isinstance(value, nn.Module):
        roots.setdefault(id(value), value)
    elif isinstance(value, torch.Tensor):
        if tensors is not None:
            tensors[id(value)] = value
    elif depth < _DEPTH and (isinstance(value, (types.FunctionType, types.MethodType, functools.partial))):
        _from_callable(value, roots, depth, tensors)
    elif isinstance(value, (list, tuple)) and len(value) <= 64:
        for item in value:
            if isinstance(item, nn.Module):
                roots.setdefault(id(item), item)
            elif tensors is not None and isinstance(item, torch.Tensor):
                tensors[id(item)] = item
