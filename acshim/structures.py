"""Flatten nested inputs/outputs to their tensors and rebuild them exactly.

Handles tuples, lists, named tuples, dicts (OrderedDict, Hugging Face ``ModelOutput``) and
dataclasses; every other object is an opaque leaf passed through as the same object. Written by
hand rather than with ``torch.utils._pytree`` because pytree treats unregistered dataclasses as
opaque leaves, so their tensors would get no gradient in a reentrant region.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

Rebuild = Callable[[list[Any]], Any]


def flatten(obj: Any) -> tuple[list[Any], Rebuild]:
    """Return the leaves of ``obj`` (tensors and opaque objects) and a function rebuilding it.

    ``rebuild(leaves)`` returns a structure of the same types with ``leaves`` put back in order.
    """
    leaves: list[Any] = []
    build = _flatten_into(obj, leaves)

    def rebuild(new_leaves: list[Any]) -> Any:
        iterator = iter(new_leaves)
        return build(iterator)

    return leaves, rebuild


def _flatten_into(obj: Any, leaves: list[Any]) -> Callable[[Any], Any]:
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return next
    if isinstance(obj, (tuple, list)):
        builders = [_flatten_into(item, leaves) for item in obj]
        kind = type(obj)
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            return lambda it: kind(*[b(it) for b in builders])
        if kind in (tuple, list):
            return lambda it: kind(b(it) for b in builders)

        def build_sequence(it: Any) -> Any:
            items = [b(it) for b in builders]
            try:
                return kind(items)
            except TypeError:
                return tuple(items) if isinstance(obj, tuple) else items

        return build_sequence
    if isinstance(obj, dict):
        keys = list(obj.keys())
        builders = [_flatten_into(obj[k], leaves) for k in keys]

        def build_mapping(it: Any) -> Any:
            values = [b(it) for b in builders]
            new = copy.copy(obj)
            for key, value in zip(keys, values):
                dict.__setitem__(new, key, value)
                if dataclasses.is_dataclass(new) and hasattr(new, key):
                    object.__setattr__(new, key, value)  # ModelOutput keeps fields as attributes too
            return new

        return build_mapping
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = [f.name for f in dataclasses.fields(obj)]
        builders = [_flatten_into(getattr(obj, n), leaves) for n in names]

        def build_dataclass(it: Any) -> Any:
            new = copy.copy(obj)
            for name, b in zip(names, builders):
                object.__setattr__(new, name, b(it))
            return new

        return build_dataclass
    leaves.append(obj)
    return next


def tensor_positions(leaves: list[Any]) -> list[int]:
    """Indexes of the tensor leaves."""
    return [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
