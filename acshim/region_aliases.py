"""A reentrant region's leaves during its recompute: one alias per use, gradients out in order.

A reentrant region differentiates its recompute in a backward of its own. If that inner backward
accumulated into the real parameters, hooks on them (DDP's reducer, optimizer-in-backward) would
fire inside it, a parameter used by several regions would be accumulated piecemeal (in another
grouping than one backward adds them: off in the last bits), and ``.grad()``/``backward(inputs=...)``
could not see the region. So every leaf the forward's outputs depend on is an input of the region's
``autograd.Function``, passed once per use (edges into its ``AccumulateGrad`` in the forward's
graph, ``region_graph.leaf_uses``), and during the recompute each use reads a fresh alias (same
storage, a leaf of its own). The inner backward fills the aliases; the region returns one
gradient per use, the last use's first, and autograd adds them into the leaf's gradient in that
order: exactly the sum one backward without checkpointing forms, also when two regions each run
a shared module twice.

Two ways to hand out the aliases:

- a parameter of the region's modules used once: while the recompute runs, the module's
  ``_parameters`` is a dict that returns a new alias for each read of ``module.<name>``. Cheap:
  a Python call per read, nothing per operator. This is the common case (a transformer block).
- any other leaf (a tensor a closure captured, a parameter used more than once: a module called
  twice, spectral norm's ``weight_orig``): a ``TorchFunctionMode`` swaps it for a new alias in the
  arguments of every torch call. It costs a Python call per operator, so it is entered only for
  regions that have such leaves.

When the recompute's aliases do not map one to one onto the uses (one torch call using a leaf
twice inside, such as ``nn.MultiheadAttention``'s ``in_proj_weight``), the region returns their
sum for the first use (a sum in another grouping: equal up to rounding).

Hand-written because ``torch.func.functional_call`` would call the module, which is the region
itself, and has no notion of one tensor per use.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map_only

Slots = list[tuple[nn.Module, str]]
"""The (module, name) places holding one parameter (tied parameters: several)."""


class _AliasPerAccess(dict):  # type: ignore[type-arg]
    """A module's ``_parameters`` during the recompute: reading a tracked name returns a new alias
    of the stored one and records it, in access order. Iteration (``parameters()``) and ``get``
    see the stored alias."""

    __slots__ = ("handed",)

    def __init__(self, parameters: dict[str, Any]) -> None:
        super().__init__(parameters)
        self.handed: dict[str, list[torch.Tensor]] = {}

    def __getitem__(self, name: str) -> Any:
        stored = dict.__getitem__(self, name)
        handed = self.handed.get(name)
        if handed is None:
            return stored
        alias = new_alias(stored)
        handed.append(alias)
        return alias


try:  # torch's own way out of functorch's transforms for the duration of a call (private, guarded)
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack as _outside_transforms
except ImportError:  # pragma: no cover - a torch without functorch's Python interpreter stack
    _outside_transforms = None


def new_alias(tensor: torch.Tensor) -> torch.Tensor:
    """A new leaf sharing ``tensor``'s storage that requires grad. Made outside any functorch
    transform the recompute is running in (``torch.vmap(m)(x)`` inside a region): an alias is the
    region's own bookkeeping, an unbatched leaf as the parameter it stands for, and functorch
    forbids ``requires_grad_`` inside its transforms."""
    if _outside_transforms is None or torch._C._functorch.peek_interpreter_stack() is None:
        return tensor.detach().requires_grad_(True)
    with _outside_transforms():
        return tensor.detach().requires_grad_(True)


def parameter_slots(modules: list[nn.Module]) -> dict[int, Slots]:
    """``{id(parameter): places}`` for the trainable parameters of ``modules``. Inside an outer
    reentrant region's recompute, the aliases its accesses handed out count as the parameters of
    the places they were read from (a region nested in a reentrant region's recompute)."""
    index: dict[int, Slots] = {}
    for module in modules:
        parameters = module._parameters
        if not parameters:
            continue
        for name, parameter in parameters.items():
            if parameter is not None and parameter.requires_grad:
                index.setdefault(id(parameter), []).append((module, name))
        if type(parameters) is _AliasPerAccess:
            for name, handed in parameters.handed.items():
                for alias in handed:
                    index.setdefault(id(alias), []).append((module, name))
    return index


def aliasable(parameter: torch.Tensor) -> bool:
    """False for parameters whose framework swaps their data through module hooks (ZeRO-3's
    partitioned parameters, FSDP1's flat parameters): an alias in their place during the recompute
    would escape those hooks. Their gradients accumulate in the inner backward, as torch's
    reentrant checkpoint does."""
    return not (hasattr(parameter, "ds_id") or getattr(parameter, "_is_flat_param", False))


@contextlib.contextmanager
def aliases_per_access(groups: list[tuple[Slots, int]]) -> Iterator[list[Record]]:
    """For the body (a recompute), every read of a grouped parameter returns a new alias. Yields,
    per group, (the stored alias, the aliases handed out) or None when the places no longer hold a
    parameter (FSDP1 with ``use_orig_params`` swaps them for plain views in backward: that one
    gets its gradient in the inner backward)."""
    records: list[Record] = []
    installed: dict[int, tuple[nn.Module, dict[str, Any], _AliasPerAccess]] = {}
    try:
        for places, _ in groups:
            current = [module._parameters.get(name) for module, name in places]
            if any(parameter is None for parameter in current):
                records.append(None)
                continue
            stored = current[0].detach().requires_grad_(True)
            handed: list[torch.Tensor] = []
            records.append((stored, handed))
            for module, name in places:
                entry = installed.get(id(module))
                if entry is None:
                    original = module._parameters
                    entry = installed[id(module)] = (module, original, _AliasPerAccess(original))
                    module.__dict__["_parameters"] = entry[2]
                dict.__setitem__(entry[2], name, stored)
                entry[2].handed[name] = handed
        yield records
    finally:
        for module, original, _ in installed.values():
            module.__dict__["_parameters"] = original


Record = tuple[torch.Tensor | None, list[torch.Tensor]] | None
"""Per aliased leaf: (the alias stored in its places, the aliases handed out per use), or None."""


class _AliasPerUse(TorchFunctionMode):
    """Every argument of a torch call that is a tracked leaf becomes a new alias, recorded."""

    def __init__(self, handed: dict[int, tuple[torch.Tensor, list[torch.Tensor]]]) -> None:
        super().__init__()
        self.handed = handed

    def _swap(self, value: torch.Tensor) -> torch.Tensor:
        entry = self.handed.get(id(value))
        if entry is None or entry[0] is not value:
            return value
        alias = new_alias(value)
        entry[1].append(alias)
        return alias

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        args, kwargs = tree_map_only(torch.Tensor, self._swap, (args, kwargs or {}))
        return func(*args, **kwargs)


@contextlib.contextmanager
def aliases_per_use(leaves: list[tuple[torch.Tensor, int]]) -> Iterator[list[Record]]:
    """For the body (a recompute), every use of each leaf in a torch call is a new alias."""
    if not leaves:
        yield []
        return
    handed: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
    records: list[Record] = []
    for leaf, _ in leaves:
        entry = handed.setdefault(id(leaf), (leaf, []))
        records.append((None, entry[1]))
    with _AliasPerUse(handed):
        yield records


def gradients(records: list[Record], uses: list[int]) -> list[torch.Tensor | None]:
    """The region's gradients for its aliased inputs: per leaf, one per use, the last use's first
    (the order one backward adds them in); their sum first when aliases and uses differ."""
    result: list[torch.Tensor | None] = []
    for record, count in zip(records, uses):
        if record is None:
            result += [None] * count
            continue
        stored, handed = record
        grads = [alias.grad for alias in handed if alias.grad is not None]
        if (stored is None or stored.grad is None) and len(grads) == count:
            result += grads[::-1]
            continue
        if stored is not None and stored.grad is not None:
            grads.append(stored.grad)
        total = None
        for grad in reversed(grads):
            total = grad if total is None else total + grad
        result += [total] + [None] * (count - 1)
    return result
