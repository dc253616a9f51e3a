"""Partitioned region inputs: each rank of a model-parallel group keeps 1/size of a region's saved
inputs and the group all-gathers them before the recompute.

The engine's ``partition`` part (shared/DESIGN.md), first spoken by DeepSpeed's
``partition_activations`` (deepspeed/runtime/activation_checkpointing/checkpointing.py:
``partition_activations`` / ``gather_partitioned_activations``). The layout is upstream's: the
input's flat contiguous elements ``[rank*n/size, (rank+1)*n/size)`` (no padding), gathered rank-major
with ``all_gather_into_tensor``. ``PartitionedInputs`` is a ``RegionOptions.saved_tensors_scope``:
it sees exactly the tensors a region keeps for backward, replaces the chosen ones by a ``Shard``
and leaves the rest alone, so reentrant and non-reentrant regions share it. A shard lives as a plain
clone, in a caller's preallocated buffer (DeepSpeed's contiguous buffers), or in a storage tier's
session (the host tier for DeepSpeed's ``cpu_checkpointing``).

``hollow()`` is upstream's memory side effect: after the forward the caller's input tensor is
emptied to a 0-dim tensor (its full data freed); the first unpack in backward gathers the full
tensor and gives the caller's tensor its data and shape back (upstream leaves it flat when the
group has one rank).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

_HOLLOW: dict[int, weakref.ref[torch.Tensor]] = {}
"""Caller tensors emptied by ``hollow()`` and not yet given their data back (by id; tensors compare
elementwise, so no WeakSet)."""

_GRAD_HOOKS: dict[int, Any] = {}
"""The restore-on-gradient hook handle of each emptied caller tensor that requires grad (by id)."""

HOLLOW_REUSE_ERROR = (
    "a checkpoint input was deallocated by a previous activation checkpoint (partition_activations empties the "
    "caller's input tensors until backward); pass a tensor that no earlier checkpoint consumed")


def is_hollow(tensor: Any) -> bool:
    """True for a caller tensor emptied by a partitioned region whose backward has not run yet."""
    ref = _HOLLOW.get(id(tensor))
    return ref is not None and ref() is tensor


def _forget(key: int) -> Callable[[Any], None]:
    def forget(ref: Any) -> None:
        if _HOLLOW.get(key) is ref:
            del _HOLLOW[key]

    return forget


class Shard:
    """One saved input, as this rank's flat partition; ``full()`` gathers it back (once)."""

    __slots__ = ("shape", "dtype", "device", "rank", "size", "group", "data", "session", "owner", "hollowed",
                 "gathered", "__weakref__")

    def __init__(self, tensor: torch.Tensor, rank: int, size: int, group: Any, buffer: torch.Tensor | None,
                 session: Any) -> None:
        self.shape, self.dtype, self.device = tensor.shape, tensor.dtype, tensor.device
        self.rank, self.size, self.group = rank, size, group
        part = tensor.numel() // size
        flat = tensor.detach().contiguous().view(-1).narrow(0, part * rank, part)
        if buffer is not None:
            self.data = buffer.copy_(flat)  # a preallocated slot (upstream's contiguous buffers)
        elif session is not None:
            self.data = session.pack(flat.clone())  # the storage tier decides where the shard lives
        else:
            self.data = flat.clone()
        self.session = session if buffer is None else None
        self.owner = weakref.ref(tensor)
        self.hollowed = False
        self.gathered: torch.Tensor | None = None

    def _part(self) -> torch.Tensor:
        return self.session.unpack(self.data) if self.session is not None else self.data

    def full(self) -> torch.Tensor:
        """The whole tensor, all-gathered over the group (collective: every rank unpacks the same
        shards in the same order, as backward visits the same regions)."""
        if self.gathered is None:
            part = self._part().to(self.device)
            if self.size == 1:
                full = part.view(self.shape)
            else:
                import torch.distributed as dist

                flat = torch.zeros(part.numel() * self.size, dtype=self.dtype, device=self.device)
                mine = flat.narrow(0, part.numel() * self.rank, part.numel())
                mine.copy_(part)
                dist.all_gather_into_tensor(flat, mine, group=self.group)
                full = flat.view(self.shape)
            self.gathered = full
            self.data = self.session = None  # the shard is not needed any more
            owner = self.owner()
            if self.hollowed and owner is not None and is_hollow(owner):
                owner.data = full  # upstream: the caller's tensor gets its gathered data and shape back
                del _HOLLOW[id(owner)]
        return self.gathered

    def hollow(self) -> None:
        """Empty the caller's tensor (0-dim, as upstream) until backward gathers it back. A caller
        tensor that requires grad also gets it back when its gradient arrives, should the region
        never unpack it (a non-reentrant region that saved nothing; upstream then leaves it empty)."""
        owner = self.owner()
        if owner is None or self.gathered is not None or self.hollowed:
            return
        owner.data = torch.empty([], dtype=self.dtype, device=self.device)
        self.hollowed = True
        key = id(owner)
        _HOLLOW[key] = weakref.ref(owner, _forget(key))
        if owner.requires_grad:
            stale = _GRAD_HOOKS.pop(key, None)
            if stale is not None:
                stale.remove()  # a previous step's hook (not removed from inside backward)
            else:
                weakref.finalize(owner, _GRAD_HOOKS.pop, key, None)  # no entry outlives its tensor
            # strong: a region that saved nothing keeps no shard, the hook is then its only owner
            _GRAD_HOOKS[key] = owner.register_hook(_restore_on_grad(self))


def _restore_on_grad(shard: Shard) -> Callable[[torch.Tensor], None]:
    def hook(grad: torch.Tensor) -> None:
        if shard.gathered is None:
            shard.full()

    return hook


class PartitionedInputs:
    """A ``saved_tensors_scope`` for one region call that keeps ``inputs`` (the region's arguments
    chosen for partitioning) as shards of a group of ``size`` ranks; other saved tensors stay as
    they are. ``buffers[i]``: a preallocated flat slot for ``inputs[i]`` (or None); ``session``: a
    storage session (``BoundaryOffload.session``) that holds the shards, e.g. the host tier."""

    def __init__(self, inputs: Sequence[torch.Tensor], rank: int, size: int, group: Any = None,
                 buffers: Sequence[torch.Tensor | None] | None = None, session: Any = None,
                 on_backward: Callable[[], None] | None = None) -> None:
        for tensor in inputs:
            if tensor.numel() % size:
                raise ValueError(f"a tensor of {tensor.numel()} elements does not split across {size} ranks")
        self.inputs = list(inputs)
        self.rank, self.size, self.group = rank, size, group
        self.buffers = list(buffers) if buffers is not None else [None] * len(self.inputs)
        self.session = session
        self.shards: dict[int, Shard] = {}
        self.on_backward = on_backward

    def _pack(self, tensor: torch.Tensor) -> Any:
        for index, candidate in enumerate(self.inputs):
            if tensor is candidate:
                shard = self.shards.get(index)
                if shard is None:
                    shard = self.shards[index] = Shard(tensor, self.rank, self.size, self.group,
                                                       self.buffers[index], self.session)
                return shard
        return tensor

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, Shard):
            return packed
        if self.on_backward is not None:
            callback, self.on_backward = self.on_backward, None
            callback()
        return packed.full()

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        if self.session is not None:
            self.session.start_group()
        with saved_tensors_hooks(self._pack, self._unpack):
            yield

    def hollow(self) -> None:
        """After the region's forward: empty every caller tensor that was partitioned."""
        for shard in self.shards.values():
            shard.hollow()
