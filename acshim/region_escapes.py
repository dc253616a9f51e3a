"""Tensors made inside a reentrant region that outlive it other than as its outputs.

A reentrant region runs its forward keeping nothing for backward (``acshim.region_graph``), and
only its outputs are connected to the region's ``autograd.Function``. A tensor made inside that
leaves another way stays in the forward's graph, which holds nothing: Hugging Face's output
recorders (``output_router_logits``, ``output_attentions``, ``output_hidden_states`` in
transformers 5) keep what submodules return from forward hooks, and a mixture-of-experts loss then
differentiates the router logits. torch's reentrant checkpoint runs its forward under ``no_grad``,
so such a tensor has no gradient and the router silently gets none from that loss.

Here every tensor a module returns inside the region's forward is noted, weakly, in call order
(a global forward hook, registered only while a reentrant forward or recompute runs on some
thread). When the forward is over, the noted tensors still alive that are not outputs (nor the
bases of output views) have escaped: they become extra outputs of the region's Function, rewired
in place to it, and in backward their gradients join the outputs' in the one backward through the
recompute, found there as the tensor the same module returned at the same call and place. The sums then form in the same
grouping as without checkpointing (the router logits' two gradients meet at the same node).

Only module outputs are found this way; a tensor that escapes through other code (a closure
appending to a list) still stops backward with the error of ``region_graph``.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from .module_watch import ModuleWatch

Key = tuple[int, int, int]
"""(the module's id, its call number in the watch, the tensor's place among the call's outputs)."""


class ModuleOutputs:
    """The tensors modules returned while a watch was open on this thread, weakly, each under its
    ``Key`` (only those with a gradient history: what a loss could differentiate). With ``wanted``
    keys (a recompute looking for its escaped tensors) only those are kept, strongly."""

    __slots__ = ("noted", "calls", "wanted", "kept")

    def __init__(self, wanted: set[Key] | None = None) -> None:
        self.noted: list[tuple[Key, weakref.ref[torch.Tensor]]] = []
        self.calls: dict[int, int] = {}
        self.wanted = wanted
        self.kept: dict[Key, torch.Tensor] = {}

    def note(self, module: nn.Module, output: Any) -> None:
        call = self.calls.get(id(module), 0)
        self.calls[id(module)] = call + 1
        for place, value in enumerate(tree_leaves(output)):
            if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                key = (id(module), call, place)
                if self.wanted is None:
                    self.noted.append((key, weakref.ref(value)))
                elif key in self.wanted:
                    self.kept[key] = value

    def escaped(self, outputs: list[torch.Tensor], since: int) -> list[tuple[Key, torch.Tensor]]:
        """(key, tensor) of every noted tensor still alive that the forward made (its node numbered
        ``since`` or later), is no view, and is neither an output nor an output's base."""
        kept = {id(t) for t in outputs}
        kept.update(id(t._base) for t in outputs if t._base is not None)
        found: list[tuple[Key, torch.Tensor]] = []
        for key, ref in self.noted:
            tensor = ref()
            if tensor is None or id(tensor) in kept or not made_inside(tensor, since):
                continue
            kept.add(id(tensor))
            found.append((key, tensor))
        return found

    def at(self, key: Key) -> torch.Tensor | None:
        """The tensor kept under ``key`` (a watch made with ``wanted``)."""
        return self.kept.get(key)


def made_inside(tensor: torch.Tensor, since: int) -> bool:
    """Whether ``tensor`` is a non-view the region's forward made (graph node ``since`` or later)."""
    node = tensor.grad_fn
    return node is not None and tensor._base is None and node._sequence_nr() >= since


_MODULE_OUTPUTS: ModuleWatch[ModuleOutputs] = ModuleWatch(
    nn.modules.module.register_module_forward_hook, lambda watch, module, args, output: watch.note(module, output))


def watching(wanted: set[Key] | None = None) -> contextlib.AbstractContextManager[ModuleOutputs]:
    """Note every module output on this thread in the body. Every open watch notes it: a region
    recomputed with a reentrant region nested in it sees the same outputs as its forward did,
    where the nested one ran as a plain call."""
    return _MODULE_OUTPUTS.watching(ModuleOutputs(wanted))
