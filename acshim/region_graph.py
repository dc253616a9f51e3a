"""A reentrant region's forward, run as the plain run would run it, and what its outputs depend on.

torch's reentrant checkpoint runs the forward under ``no_grad``. Some kernels differ with grad
disabled (CPU ``nn.LSTM`` takes another path: every gradient differs by up to 1.9e-6), and the
forward then leaves no graph to learn from. acshim runs it with grad enabled instead, under
saved-tensor hooks that drop every saved tensor: the same kernels as without checkpointing, no
activation held, and a graph whose nodes tell which leaves (parameters, tensors a closure captured)
each output depends on, and through how many edges. The graph dies with the detached outputs.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


def _discard_saved(_: torch.Tensor) -> None:
    return None


def _never_unpacked(_: None) -> torch.Tensor:
    raise RuntimeError("acshim: a reentrant region's forward graph was used in backward")  # unreachable


def saving_nothing() -> contextlib.ExitStack:
    """Grad enabled, every tensor the forward's operators save dropped at once."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.enable_grad())
    stack.enter_context(torch.autograd.graph.saved_tensors_hooks(_discard_saved, _never_unpacked))
    return stack


_get_sequence_nr = getattr(torch._C._autograd, "_get_sequence_nr", None)


def next_node_number() -> int:
    """The sequence number the next autograd node created on this thread gets: nodes numbered
    lower belong to the graph outside the region (its inputs' history)."""
    return _get_sequence_nr() if _get_sequence_nr is not None else 0


def _accumulate_grad_type() -> type:
    leaf = torch.empty(0, requires_grad=True)
    return type(leaf.view(0).grad_fn.next_functions[0][0])


_ACCUMULATE_GRAD = _accumulate_grad_type()


def leaf_uses(outputs: list[torch.Tensor], since: int) -> dict[int, list[Any]]:
    """The leaves the forward's ``outputs`` depend on through nodes created since node ``since``:
    ``{id(leaf): [leaf, edges]}`` in the order found, ``edges`` counting the graph edges into the
    leaf (its uses; an output that is itself a leaf counts once). The walk stops at older nodes."""
    found: dict[int, list[Any]] = {}
    stack = []
    for output in outputs:
        node = output.grad_fn
        if node is not None:
            stack.append(node)
        elif output.requires_grad:
            entry = found.setdefault(id(output), [output, 0])
            entry[1] += 1
    seen = set(stack)
    while stack:
        for successor, _ in stack.pop().next_functions:
            if successor is None:
                continue
            if type(successor) is _ACCUMULATE_GRAD:
                leaf = successor.variable
                entry = found.get(id(leaf))
                if entry is None:
                    found[id(leaf)] = [leaf, 1]
                else:
                    entry[1] += 1
            elif successor not in seen:
                seen.add(successor)
                if successor._sequence_nr() >= since:
                    stack.append(successor)
    return found
