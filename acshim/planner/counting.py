"""Count what a forward would save for backward, without holding any of it.

Planning must learn how much activation memory the model holds without checkpointing (a fractional
budget is a share of it) without ever holding it. ``SavedBytes`` is a ``saved_tensors_hooks`` pair
whose pack records each saved tensor's storage (once, by storage, as the tracker counts) under the
part of the model running at the time (``owner``) and returns nothing to keep: the forward runs with
grad, builds its graph, and the graph holds no tensor. Its backward can never run (the placeholders
have nothing to unpack), which is why only forward-only planning steps use it.
"""

from __future__ import annotations

import weakref
from types import TracebackType
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

from .tracker import storage_key

OUTSIDE = -1
"""``owner`` of what is saved outside every region (embeddings, head, loss)."""


class _Unpackable:
    """What the graph keeps instead of a saved tensor."""

    __slots__ = ()


_PLACEHOLDER = _Unpackable()


class SavedBytes:
    """``with SavedBytes(excluded) as saved:`` counts saved bytes per ``saved.owner`` (set it when a
    region starts and ends); storages in ``excluded`` (parameters, the step's inputs) are left out."""

    def __init__(self, excluded: set[int]) -> None:
        self.excluded = excluded
        self.owner = OUTSIDE
        self.bytes: dict[int, int] = {}
        self.largest = 0
        """The largest storage saved (an allocation the planner's guard leaves room for)."""
        self._seen: dict[int, weakref.ref[torch.Tensor]] = {}
        """Storage id -> a tensor on it, weakly: nothing here is held, so a storage can be freed and
        its id reused by a later one, which counts anew once the tensor seen on the old one is gone."""
        self._hooks = saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> Any:
        found = storage_key(tensor)
        if found is None or found[0] in self.excluded:
            return _PLACEHOLDER
        seen = self._seen.get(found[0])
        if seen is None or seen() is None:
            self._seen[found[0]] = weakref.ref(tensor)
            size = found[1].nbytes()
            self.bytes[self.owner] = self.bytes.get(self.owner, 0) + size
            self.largest = max(self.largest, size)
        return _PLACEHOLDER

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        raise RuntimeError("acshim planner: a forward run to count saved bytes was differentiated; this is a bug")

    def total(self) -> int:
        return sum(self.bytes.values())

    def __enter__(self) -> SavedBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self._hooks.__exit__(exc_type, exc, traceback)
        self._seen.clear()
