"""A pool of page-locked host memory: a few slabs, cut into regions, reused step after step.

Copies between a GPU and host memory are asynchronous only from page-locked ("pinned") memory, and
pinning is slow (``cudaHostAlloc``/``cudaHostRegister`` stall the first steps: torchtune issue 2076,
pytorch issue 86097). So the CUDA backend never pins per copy: it takes regions of a pool.

- **Sized from the schedule.** The pool grows only when a request fits in no free region, by a slab
  of ``max(request, growth x pool)``. The first step's saves grow it to what the schedule keeps in the
  tier at its peak (plus at most ``growth``); every later step with the same schedule takes exactly
  the same regions (first fit over slabs in creation order is deterministic), so it pins nothing new.
- **Freed regions coalesce** with their free neighbours in the same slab.
- **Bounded** (optional ``capacity``): ``take`` blocks while the regions in use would exceed it (the
  disk tier's staging: back-pressure on forward when the disk is slower than the GPU); a request
  larger than the capacity is served when nothing else is in use, so nothing waits forever.

Frees arrive from the release thread (``storage.reaper``) moments after a graph dies; ``take`` first
lets pending releases land (``settle``: by default whatever the storage tier installed with
``install_settle``, a no-op when nothing is pending), so a step starting right after the previous
backward finds the regions it used, in the same places, and no new ones.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

_settle: Callable[[], object] | None = None


def install_settle(function: Callable[[], object] | None) -> None:
    """Set what pools call before growing to let frees queued on another thread land."""
    global _settle
    _settle = function


def settle_pending_frees() -> None:
    """Wait for frees queued on another thread (see ``install_settle``); no-op if none installed."""
    if _settle is not None:
        _settle()


@dataclass
class PoolStats:
    """Counters of one pool (the simulator's tests read them)."""

    allocations: int = 0
    """Slabs pinned so far (each a ``cudaHostRegister``)."""
    pinned_bytes: int = 0
    in_use_bytes: int = 0
    """Bytes of regions handed out (each rounded up to the alignment)."""
    peak_in_use_bytes: int = 0
    requested_bytes: int = 0
    """Bytes asked for by the regions handed out."""
    peak_requested_bytes: int = 0


class Region:
    """Part of a slab: ``tensor`` (1-D ``uint8``, ``size`` bytes, aligned) until given back."""

    __slots__ = ("slab", "offset", "size", "requested", "tensor")

    def __init__(self, slab: _Slab, offset: int, size: int, requested: int) -> None:
        self.slab, self.offset, self.size, self.requested = slab, offset, size, requested
        self.tensor = slab.tensor[offset:offset + size]

    def bytes(self, nbytes: int | None = None) -> torch.Tensor:
        """The first ``nbytes`` (default: as many as were asked for) as a 1-D ``uint8`` tensor."""
        return self.tensor[:self.requested if nbytes is None else nbytes]


class _Slab:
    __slots__ = ("tensor", "address", "size", "free")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.address, self.size = tensor, tensor.data_ptr(), tensor.numel()
        self.free: list[list[int]] = [[0, self.size]]
        """Free ranges ``[offset, size]``, sorted and coalesced."""

    def take(self, size: int, alignment: int) -> int | None:
        for i, (offset, length) in enumerate(self.free):
            start = offset + (-(self.address + offset) % alignment)
            if start + size > offset + length:
                continue
            del self.free[i]
            if start + size < offset + length:
                self.free.insert(i, [start + size, offset + length - start - size])
            if start > offset:
                self.free.insert(i, [offset, start - offset])
            return start
        return None

    def give(self, offset: int, size: int) -> None:
        free = self.free
        i = bisect.bisect_left(free, [offset, 0])
        if i < len(free) and offset + size == free[i][0]:
            size += free.pop(i)[1]
        if i and free[i - 1][0] + free[i - 1][1] == offset:
            i -= 1
            offset, size = free[i][0], free.pop(i)[1] + size
        free.insert(i, [offset, size])


class PinnedPool:
    """Regions of pinned host memory. Thread-safe.

    Args:
        pin: allocates ``n`` bytes of pinned, page-aligned memory (``CudaRuntime.pin``).
        alignment: every region starts at a multiple of this address (4096 for ``O_DIRECT`` I/O).
        capacity: most bytes in use at once before ``take`` blocks (None: unbounded).
        growth: a new slab is at least this fraction of the pool (the most it can overshoot).
        min_slab: a new slab is at least this many bytes.
        settle: called (without the lock) before growing, to let pending frees land (None: never).
    """

    def __init__(self, pin: Callable[[int], torch.Tensor], alignment: int = 64, capacity: int | None = None,
                 growth: float = 1 / 32, settle: Callable[[], object] | None = settle_pending_frees,
                 min_slab: int = 0) -> None:
        self._pin, self.alignment, self.capacity = pin, alignment, capacity
        self.growth, self._settle, self.min_slab = growth, settle, min_slab
        self._slabs: list[_Slab] = []
        self._changed = threading.Condition(threading.Lock())
        self.stats = PoolStats()

    def take(self, nbytes: int, block: bool = True) -> Region:
        """A region of at least ``nbytes``; ``block``: wait while the capacity is used up."""
        size = max(self.alignment, -(-nbytes // self.alignment) * self.alignment)
        if self._settle is not None:
            self._settle()  # frees already queued land first: the same regions as last step, not others
        settled = False
        with self._changed:
            while True:
                if block and self.capacity is not None:
                    while self.stats.in_use_bytes and self.stats.in_use_bytes + size > self.capacity:
                        self._changed.wait()
                region = self._carve(size, nbytes)
                if region is not None:
                    return region
                if settled or self._settle is None:
                    break
                settled = True
                self._changed.release()  # frees land on the release thread, which takes this lock
                try:
                    self._settle()
                finally:
                    self._changed.acquire()
            grown = max(size, int(self.stats.pinned_bytes * self.growth), self.min_slab)
            slab = _Slab(self._pin(-(-grown // self.alignment) * self.alignment))
            self._slabs.append(slab)
            self.stats.allocations += 1
            self.stats.pinned_bytes += slab.size
            region = self._carve(size, nbytes)
            if region is None:
                raise RuntimeError(f"acshim offload: pinned memory at {slab.address:#x} is not aligned to "
                                   f"{self.alignment} bytes (the runtime's pin() must return page-aligned memory)")
            return region

    def _carve(self, size: int, nbytes: int) -> Region | None:
        for slab in self._slabs:
            offset = slab.take(size, self.alignment)
            if offset is not None:
                stats = self.stats
                stats.in_use_bytes += size
                stats.peak_in_use_bytes = max(stats.peak_in_use_bytes, stats.in_use_bytes)
                stats.requested_bytes += nbytes
                stats.peak_requested_bytes = max(stats.peak_requested_bytes, stats.requested_bytes)
                return Region(slab, offset, size, nbytes)
        return None

    def give(self, region: Region) -> None:
        """Return a region. Its last copy must have finished reading or writing it (the caller's
        business: the backend orders or waits for it)."""
        with self._changed:
            region.slab.give(region.offset, region.size)
            self.stats.in_use_bytes -= region.size
            self.stats.requested_bytes -= region.requested
            self._changed.notify_all()

    def close(self, unpin: Callable[[torch.Tensor], object]) -> None:
        """Unpin every slab (nothing may be in use)."""
        with self._changed:
            for slab in self._slabs:
                unpin(slab.tensor)
            self._slabs.clear()
            self.stats.pinned_bytes = 0
