"""Measure what one training step holds for backward: total bytes and bytes per block.

Memory held for backward peaks when forward ends: everything autograd saved, everything a region
keeps to recompute from (its inputs, tensors in its closure or on its ctx), and the outputs still
referenced. ``measure_memory`` runs the forward under a ``TorchDispatchMode`` that keeps a handle on
every storage an operator creates, then, when forward ends, counts the storages that something else
still references (the storage's reference count is above our one handle). That sees tensors held
anywhere (autograd, Python closures, ctx attributes, hooks), counts a storage shared by views once,
and attributes each storage to the block whose forward created it. Parameters, buffers and the
step's inputs are excluded: they are held whether or not anything is checkpointed.

Written by hand: torch's CPU allocator keeps no statistics and the profiler records almost nothing on
CPU (see docs/measuring.md); storage reference counts are exact.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from . import structures
from .blocks import find_blocks

OTHER = "<other>"


@dataclass
class MemoryReport:
    """Bytes held for backward when forward ends (the peak of saved activations)."""

    held_bytes: int
    per_block: dict[str, int] = field(default_factory=dict)
    loss: torch.Tensor | None = None

    @property
    def other_bytes(self) -> int:
        """Held bytes created outside every block (embeddings, head, loss)."""
        return self.per_block.get(OTHER, 0)

    def __str__(self) -> str:
        lines = [f"held for backward: {self.held_bytes / 2**20:.2f} MiB"]
        lines += [f"  {name}: {size / 2**20:.2f} MiB" for name, size in self.per_block.items()]
        return "\n".join(lines)


def storage_key(tensor: torch.Tensor) -> tuple[int, torch.UntypedStorage] | None:
    """``(id, storage)`` of a strided tensor's storage, else None (what held-bytes accounting keys on)."""
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided or tensor.device.type == "meta":
        return None
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return storage._cdata, storage


class _StorageTracker(TorchDispatchMode):
    def __init__(self, excluded: set[int]) -> None:
        super().__init__()
        self.excluded = excluded
        self.storages: dict[int, tuple[torch.UntypedStorage, str]] = {}
        self.block_stack: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        leaves, _ = structures.flatten(out)
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                found = storage_key(leaf)
                if found and found[0] not in self.excluded and found[0] not in self.storages:
                    block = self.block_stack[-1] if self.block_stack else OTHER
                    self.storages[found[0]] = (found[1], block)
        return out

    def held(self) -> dict[str, int]:
        per_block: dict[str, int] = {}
        for key, (storage, block) in self.storages.items():
            if torch._C._storage_Use_Count(key) > 1:  # someone besides this tracker holds it
                per_block[block] = per_block.get(block, 0) + storage.nbytes()
        return per_block


def _enter_block(tracker: _StorageTracker, name: str) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any) -> None:
        tracker.block_stack.append(name)

    return hook


def _leave_block(tracker: _StorageTracker) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        tracker.block_stack.pop()

    return hook


def default_loss(output: Any) -> torch.Tensor:
    """``output.loss`` when the model computed one (Hugging Face), else the sum of the first
    floating-point tensor in the output."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    leaves, _ = structures.flatten(output)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return leaf.sum()
    raise ValueError("the model returned no floating-point tensor; pass loss_fn=")


def measure_memory(
    model: nn.Module,
    inputs: Any,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    blocks: Iterable[tuple[str, nn.Module]] | None = None,
    backward: bool = True,
) -> MemoryReport:
    """Run one training step of ``model`` on ``inputs`` and report the memory held for backward.

    ``inputs``: a tensor, a tuple of positional inputs, or a dict of keyword inputs.
    ``loss_fn(output) -> scalar``: defaults to ``default_loss``. ``blocks``: ``(name, module)`` pairs
    to attribute memory to (default: the model's repeated blocks, else its top-level children).
    ``backward``: run backward afterwards so the step completes (gradients accumulate as usual).
    Copies a storage tier still has in flight when forward ends are waited for first: the tensors
    they are writing leave memory once written, so they are not counted as held.
    """
    # imported here: in a source checkout acshim.backends is mapped after this module loads
    from .backends.cpu import wait_for_copies

    if not isinstance(model, nn.Module):
        raise TypeError(f"measure_memory needs an nn.Module, got {type(model).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"measure_memory: loss_fn must be a function output -> scalar loss (or None), got {loss_fn!r}")
    args, kwargs = (tuple(inputs), {}) if isinstance(inputs, (tuple, list)) else (
        ((), dict(inputs)) if isinstance(inputs, dict) else ((inputs,), {}))
    block_list = list(blocks) if blocks is not None else (find_blocks(model) or list(model.named_children()))

    excluded: set[int] = set()
    for tensor in [*model.parameters(), *model.buffers()]:
        found = storage_key(tensor)
        if found:
            excluded.add(found[0])
    input_leaves, _ = structures.flatten((args, kwargs))
    for leaf in input_leaves:
        if isinstance(leaf, torch.Tensor) and (found := storage_key(leaf)):
            excluded.add(found[0])

    tracker = _StorageTracker(excluded)
    handles = []
    for name, module in block_list:
        handles.append(module.register_forward_pre_hook(_enter_block(tracker, name)))
        handles.append(module.register_forward_hook(_leave_block(tracker), always_call=True))
    try:
        with tracker:
            output = model(*args, **kwargs)
            loss = (loss_fn or default_loss)(output)
            del output
            wait_for_copies()  # what a storage tier is still writing leaves memory once written
        per_block = tracker.held()
    finally:
        for handle in handles:
            handle.remove()
    tracker.storages.clear()
    report = MemoryReport(held_bytes=sum(per_block.values()),
                          per_block={name: per_block.get(name, 0) for name, _ in block_list}, loss=loss.detach())
    if OTHER in per_block:
        report.per_block[OTHER] = per_block[OTHER]
    if backward:
        loss.backward()
    return report
