"""CUDA backend: copies on two side streams (device to host, host to device) through pinned pools.

Every ordering is an event or a stream wait, never a device-wide synchronisation:

- **Saved** (pack time): an event on the stream the tensor was produced on (the current stream when
  autograd saves it). A copy out issued later (prefetch > 0 defers it to a later group, when another
  stream may be current) waits on that event, not on whatever stream is current then.
- **Out, host tier**: the D2H stream waits for that event and copies into a region of the host pool
  (``PinnedPool``: reused every step, nothing pinned per copy); ``record_stream`` keeps the device
  memory from being reused before the copy has read it. The region is the tier's slot. ``wait`` on a
  copy out blocks the host on the copy's event, so the session's in-flight limit is real
  back-pressure.
- **Out, disk tier**: the same copy into a region of the staging pool (page-aligned, bounded: forward
  waits for a region when the disk is slower than the GPU, never for a file write of its own), then
  a worker thread waits for the copy's event, writes the region to the tier and frees it.
- **In**: the H2D stream copies into a buffer allocated on it (host tier: after waiting for the copy
  out's event; disk tier: a worker reads the file into a staging region, copies, and frees the
  region once its copy has finished). ``wait`` makes the *current* stream wait for the copy's event
  (the CPU does not block) and ``record_stream`` ties the buffer to that stream.
- **Reload buffers are freed in stream order** (issue 27): ``wait`` lends the buffer to the stream
  that consumes it and keeps it; once nothing else holds it (autograd's node has run), the H2D stream
  waits for an event recorded on that consumer stream and the buffer is dropped, so the caching
  allocator reuses the block for the next reload at once, without ``record_stream``, whose block is
  reusable only after the device has caught up (torchtune frees its reload buffers the same way).
  Reserved memory for reloads is then bounded by the prefetch horizon even when the device runs a
  whole backward behind the host.
- **Region reuse after a reload**: a host-tier region given back while a prefetched copy in may
  still read it (partial backward, a graph dropped mid-backward) is reused only after the D2H stream
  has waited for that copy.
- **Devices**: every call made on a worker or release thread runs under a device guard for this
  backend's device (no context on GPU 0 for a rank on ``cuda:1``); pinned memory is registered
  portable (``runtime.py``).
- **Graph capture**: packing under CUDA graph capture raises at once, naming the fix (capture
  forbids the host waits and the pinned registration this path needs).
- **Unpinning**: ``close`` (or the backend's garbage collection) waits for the side streams and
  unregisters every pinned slab before its memory is unmapped.
- **Errors**: a failed file write keeps the tensor on its device (copied back from the staging
  region), so backward runs as if nothing moved (its consumer stream is recorded at unpack); a failed read raises from ``wait`` only, which the
  session turns into ``OffloadIOError``; ``done`` never raises.

Everything CUDA goes through ``runtime`` (``backends/runtime.py``): ``torch.cuda`` on a GPU, the
happens-before simulator (``backends/simcuda.py``) in the tests, which prove that each wait and
each ``record_stream``, stream-ordered release, device guard, unregister and capture check here is
needed (``tests/tools/mutate_cuda.py``). Not run on a GPU yet (none is available to this project).
"""

from __future__ import annotations

import functools
import threading
import weakref
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import Any

import torch

from .base import Backend, Ticket, Tier, TransferFailed
from .cpu import WorkerPool, free_when_written
from .fileio import ALIGNMENT, padded
from .pinned import PinnedPool, Region
from .runtime import CudaRuntime, TorchCudaRuntime

DEFAULT_STAGING_BYTES = 64 << 20
"""Disk tier: most bytes of pinned staging in use at once (forward waits for a region beyond it)."""
STAGING_SLAB_BYTES = 8 << 20
"""Disk tier: staging grows by at least this much. How many copies wait for the disk at once depends
on thread timing, not only on the schedule; slabs this large absorb that, so a steady state pins
nothing new (the host tier's pool, whose regions are the tier itself, grows by need only)."""


class Ready:
    """A saved tensor's production point: an event recorded on its stream at pack time."""

    __slots__ = ("event", "stream")

    def __init__(self, event: Any, stream: Any) -> None:
        self.event, self.stream = event, stream


CAPTURE_ERROR = (
    "acshim offload: a tensor was saved for backward during CUDA graph capture (torch.cuda.graph, or "
    "torch.compile with mode='reduce-overhead' / cudagraphs). Offloading needs host waits and pinned-memory "
    "registration, which capture forbids. Fix: keep the captured code out of offload (acshim.storage.no_offload() "
    "around it, or offload outside the captured function), or compile without cudagraphs (mode='default').")


def _pin_on(runtime: CudaRuntime, device: torch.device, nbytes: int) -> torch.Tensor:
    """``runtime.pin`` under ``device`` (pool growth may happen on a worker thread)."""
    with runtime.device(device):
        return runtime.pin(nbytes)


def _unpin_pools(runtime: CudaRuntime, streams: tuple[Any, ...], pools: tuple[PinnedPool, ...],
                 device: torch.device) -> None:
    """Wait for the side streams, then unregister every slab of ``pools`` (close and collection)."""
    with runtime.device(device):
        for stream in streams:
            stream.synchronize()
        for pool in pools:
            pool.close(runtime.unpin)


class CudaBackend(Backend):
    """Transfers for tensors on one CUDA device (or the simulator's stand-in for one)."""

    def __init__(self, device: torch.device, runtime: CudaRuntime | None = None, workers: int = 2,
                 staging_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        self.device = torch.device(device)
        self.runtime = runtime if runtime is not None else TorchCudaRuntime()
        self._d2h = self.runtime.Stream(self.device)
        self._h2d = self.runtime.Stream(self.device)
        pin = functools.partial(_pin_on, self.runtime, self.device)  # not a bound method: the finalizer
        self.host_pool = PinnedPool(pin)  # below holds the pools, and must not keep the backend alive
        """The host tier's slots."""
        self.staging = PinnedPool(pin, alignment=ALIGNMENT, capacity=staging_bytes,
                                  min_slab=min(STAGING_SLAB_BYTES, staging_bytes))
        """The disk tier's staging regions (aligned for O_DIRECT, bounded)."""
        self._io = WorkerPool(workers)
        self._lent: list[tuple[torch.Tensor, Any]] = []
        """Reload buffers handed to backward, with the stream consuming each (see ``_retire``)."""
        self._lent_lock = threading.Lock()
        self._unpin = weakref.finalize(self, _unpin_pools, self.runtime, (self._d2h, self._h2d),
                                       (self.host_pool, self.staging), self.device)
        self._unpin.atexit = False  # at exit the process's memory goes anyway; CUDA may be torn down

    def _on_device(self) -> AbstractContextManager[Any]:
        """This backend's device made current on the calling thread (workers start on device 0)."""
        return self.runtime.device(self.device)

    def handles(self, data: torch.Tensor) -> bool:
        return self.runtime.is_device_tensor(data, self.device)

    def copy_out_can_fail(self, tier: Tier) -> bool:
        return tier.kind == "disk"  # a copy into a pinned region of the host tier cannot fail

    def _check_capture(self) -> None:
        if self.runtime.is_capturing(self.device):
            raise RuntimeError(CAPTURE_ERROR)

    # ------------------------------------------------------------------------------------ out

    def saved(self, data: torch.Tensor) -> Ready:
        self._check_capture()
        stream = self.runtime.current_stream(self.device)
        event = self.runtime.Event()
        event.record(stream)
        return Ready(event, stream)

    def copy_out(self, data: torch.Tensor, tier: Tier, ready: Any = None) -> Ticket:
        if ready is None:
            ready = self.saved(data)
        nbytes = data.numel()
        if tier.kind == "host":
            region = self.host_pool.take(nbytes)
        else:
            region = self.staging.take(padded(nbytes))
        runtime = self.runtime
        self._d2h.wait_event(ready.event)
        with runtime.stream(self._d2h):
            runtime.copy(region.bytes(nbytes), data)
            landed = runtime.Event()
            landed.record(self._d2h)
        runtime.record_stream(data, self._d2h)
        ticket = Ticket(nbytes=nbytes, device=data.device)
        if tier.kind == "host":
            ticket.slot, ticket.pending = region, landed
        else:
            ticket.pending = self._io.submit(self._write_staged, tier, landed, region, nbytes)
        return ticket

    def _write_staged(self, tier: Tier, landed: Any, region: Region, nbytes: int) -> Any:
        """Worker: write a staged copy to the tier once it has landed; on failure keep the tensor on
        its device (a copy of the staged bytes, tied at unpack to the stream backward uses it on)."""
        try:
            with self._on_device():
                landed.synchronize()
                try:
                    return tier.write(region.bytes(nbytes))
                except OSError as error:
                    raise TransferFailed(error, self._back_to_device(region, nbytes)) from error
        finally:
            self.staging.give(region)

    def _back_to_device(self, region: Region, nbytes: int) -> torch.Tensor:
        runtime = self.runtime
        with runtime.stream(self._h2d):
            kept = runtime.empty(nbytes, self.device)
            runtime.copy(kept, region.bytes(nbytes))
            copied = runtime.Event()
            copied.record(self._h2d)
        copied.synchronize()  # the staging region is given back next, and the tensor used at once
        return kept

    def kept_used(self, data: torch.Tensor) -> None:
        """A tensor kept after a failed write (``TransferFailed.data``) is used on the current stream."""
        self.runtime.record_stream(data, self.runtime.current_stream(self.device))

    # ------------------------------------------------------------------------------------- in

    def copy_in(self, stored: Ticket, tier: Tier) -> Ticket:
        self._check_capture()
        self._retire()  # the buffers backward is done with go back first: this reload may reuse one
        ticket = Ticket(nbytes=stored.nbytes, device=stored.device, source=stored)
        if isinstance(stored.pending, Future):  # disk: a worker reads, then uploads
            ticket.pending = self._io.submit(self._read_staged, tier, stored.pending, stored.nbytes)
            return ticket
        runtime = self.runtime
        self._h2d.wait_event(stored.pending)
        with runtime.stream(self._h2d):
            ticket.result = runtime.empty(stored.nbytes, self.device)
            runtime.copy(ticket.result, stored.slot.bytes(stored.nbytes))
            ticket.pending = runtime.Event()
            ticket.pending.record(self._h2d)
        stored.extra["read"] = ticket.pending  # the slot's region is reused only after this copy
        return ticket

    def _read_staged(self, tier: Tier, written: Future[Any], nbytes: int) -> tuple[torch.Tensor, Any]:
        """Worker: read a slot into a staging region and upload it; the region is free again once
        the upload has read it."""
        slot = written.result()  # a failed write raises TransferFailed (holding the kept tensor)
        with self._on_device():
            return self._upload(tier, slot, nbytes)

    def _upload(self, tier: Tier, slot: Any, nbytes: int) -> tuple[torch.Tensor, Any]:
        region = self.staging.take(padded(nbytes), block=False)  # never waits on other workers' writes
        try:
            tier.read_into(slot, region.bytes(padded(nbytes)))
            runtime = self.runtime
            with runtime.stream(self._h2d):
                result = runtime.empty(nbytes, self.device)
                runtime.copy(result, region.bytes(nbytes))
                arrived = runtime.Event()
                arrived.record(self._h2d)
            arrived.synchronize()
        finally:
            self.staging.give(region)
        return result, arrived

    # ---------------------------------------------------------------------------------- both

    def done(self, ticket: Ticket) -> bool:
        pending = ticket.pending
        if isinstance(pending, Future):
            return pending.done()  # a failed copy is done too: ``wait`` raises its error
        return bool(pending.query())

    def wait(self, ticket: Ticket) -> torch.Tensor | None:
        pending = ticket.pending
        if isinstance(pending, Future):
            value = pending.result()
            if ticket.source is None:
                return None
            ticket.result, ticket.pending = value
        elif ticket.source is None:
            pending.synchronize()  # back-pressure: the device bytes are free once their copy landed
            return None
        current = self.runtime.current_stream(self.device)
        current.wait_event(ticket.pending)
        self._lend(ticket.result, current)
        return ticket.result

    def _lend(self, buffer: torch.Tensor, consumer: Any) -> None:
        """``buffer`` (allocated on the H2D stream) is used on ``consumer`` from now on."""
        with self._lent_lock:
            self._lent.append((buffer.detach(), consumer))  # an alias of our own: the caller's counts apart

    def _retire(self) -> None:
        """Free the reload buffers nothing but this backend holds any more, in stream order: the H2D
        stream (their allocation stream) waits for their consumer's work issued so far, then they are
        dropped; the allocator hands their blocks to the next reloads at once (stream-ordered reuse)."""
        with self._lent_lock:  # held until they are dropped: a reload issued meanwhile finds their blocks
            if not self._lent:
                return
            done, self._lent = _split_unused(self._lent)
            for consumer in {id(stream): stream for _, stream in done}.values():
                with self._on_device():
                    self._h2d.wait_stream(consumer)
            done.clear()

    def release(self, stored: Ticket, tier: Tier) -> None:
        if isinstance(stored.pending, Future):
            free_when_written(tier, stored.pending)
        elif stored.slot is not None:
            read = stored.extra.pop("read", None)
            if read is not None:  # a prefetched copy in may still read the region: later writes wait for it
                with self._on_device():
                    self._d2h.wait_event(read)
            self.host_pool.give(stored.slot)
            stored.slot = None
        self._retire()  # the end of a backward: its last reload buffers

    def in_flight_limit(self, tier: Tier, requested: int) -> int | None:
        # Disk tier: the staging pool bounds what waits for the disk (forward waits for a region),
        # so the session need not wait for file writes; host tier: the session's bytes in flight.
        return None if tier.kind == "disk" else requested

    def close(self) -> None:
        """Stop the workers, give back the reload buffers, wait for the side streams, unpin every slab."""
        self._io.shutdown()
        with self._lent_lock:
            lent, self._lent = self._lent, []
        with self._on_device():  # close may run on any thread
            for buffer, consumer in lent:  # a graph may still use them: the allocator's rule
                self.runtime.record_stream(buffer, consumer)
        self._unpin()


def _split_unused(lent: list[tuple[torch.Tensor, Any]]) -> tuple[list[tuple[torch.Tensor, Any]],
                                                                   list[tuple[torch.Tensor, Any]]]:
    """(buffers only the list holds, the others): a storage's use count is 2 when only the list's
    tensor and the temporary storage object asked for it refer to it."""
    unused, used = [], []
    for entry in lent:
        (unused if torch._C._storage_Use_Count(entry[0].untyped_storage()._cdata) <= 2 else used).append(entry)
    return unused, used
