"""CPU backend: worker threads run the tier's blocking writes and reads (host memory or disk files).

The forward/backward thread only submits work. Reads of a tensor are ordered after its write by
waiting on the write's future inside the worker; writes never wait on anything, and are always
submitted before their reads, so a FIFO pool cannot deadlock.

fork: a child process inherits the pool but none of its threads, so a copy submitted there would
wait forever. Each backend starts a fresh pool in the child (``os.register_at_fork``); copies that
were in flight in the parent fail in the child with a clear error instead of hanging.
"""

from __future__ import annotations

import os
import threading
import weakref
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import Any

import torch

from .base import Backend, Ticket, Tier, TransferFailed


def write_keeping_data(tier: Tier, data: torch.Tensor) -> Any:
    """``tier.write(data)``; on an I/O error raise ``TransferFailed`` carrying ``data`` (kept)."""
    try:
        return tier.write(data)
    except OSError as error:
        raise TransferFailed(error, data) from error


def write_from(tier: Tier, holder: list[torch.Tensor]) -> Any:
    """``write_keeping_data`` of the tensor taken out of ``holder``: a ``ThreadPoolExecutor`` work
    item keeps its arguments until after its future is done, so the bytes passed directly stayed
    alive a moment after ``wait`` returned (forward's held bytes then depended on thread timing)."""
    return write_keeping_data(tier, holder.pop())


def read_after_write(tier: Tier, written: Future[Any]) -> torch.Tensor:
    """Wait for the write that produced the slot (on this worker), then read the slot back."""
    return tier.read(written.result())


def free_when_written(tier: Tier, written: Future[Any]) -> None:
    """Free the slot as soon as its write has finished (at once if it has)."""

    def free(future: Future[Any]) -> None:
        if not future.cancelled() and future.exception() is None:
            tier.free(future.result())

    written.add_done_callback(free)


WORKER_STACK_BYTES = 1 << 20
"""Stack of each worker thread: they run a few shallow calls. The default (8 MiB) lets the kernel back
a touched stack with a 2 MiB transparent huge page, 2 MiB of resident memory per worker that a memory
budget would count for the rest of the run."""


def _start_workers(pool: ThreadPoolExecutor, workers: int) -> None:
    """Start all of ``pool``'s threads now, with ``WORKER_STACK_BYTES`` stacks (``ThreadPoolExecutor``
    starts them lazily, with the process's default stack size)."""
    previous = threading.stack_size(WORKER_STACK_BYTES)
    try:
        ready = threading.Barrier(workers + 1)
        started = [pool.submit(ready.wait) for _ in range(workers)]
        ready.wait()
        for future in started:
            future.result()
    finally:
        threading.stack_size(previous)


class WorkerPool:
    """A ``ThreadPoolExecutor`` that survives ``fork``: the child gets fresh threads, and the futures
    the parent had in flight fail there (``RuntimeError``) instead of never finishing."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._executor = self._start()
        self._in_flight: weakref.WeakSet[Future[Any]] = weakref.WeakSet()
        _pools.add(self)

    def _start(self) -> ThreadPoolExecutor:
        executor = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="acshim-offload")
        _start_workers(executor, self.workers)
        return executor

    def submit(self, function: Any, *args: Any) -> Future[Any]:
        future = self._executor.submit(function, *args)
        self._in_flight.add(future)
        return future

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)

    def _forked(self) -> None:
        self._executor = self._start()  # the parent's executor has no threads here; left unused
        for future in list(self._in_flight):
            if not future.done():
                future.set_exception(RuntimeError(FORKED_COPY))
        self._in_flight = weakref.WeakSet()


FORKED_COPY = ("acshim offload: this saved tensor's copy was in flight when the process forked; it belongs "
               "to the parent process. Run backward in the process that ran the forward.")

_pools: weakref.WeakSet[WorkerPool] = weakref.WeakSet()


def wait_for_copies(timeout: float = 10.0) -> None:
    """Wait until every copy the worker pools have in flight has ended (``timeout`` seconds at most
    for each); a copy's failure is its session's to report, not raised here."""
    for pool in list(_pools):
        for future in list(pool._in_flight):
            try:
                future.exception(timeout=timeout)
            except (TimeoutError, CancelledError):
                pass


def _after_fork_in_child() -> None:
    for pool in list(_pools):
        pool._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)


class CpuBackend(Backend):
    """Moves CPU tensors to a tier with ``workers`` threads (the tier's I/O releases the GIL)."""

    def __init__(self, workers: int = 2) -> None:
        self._pool = WorkerPool(workers)

    def copy_out(self, data: torch.Tensor, tier: Tier, ready: Any = None) -> Ticket:
        future = self._pool.submit(write_from, tier, [data])
        return Ticket(nbytes=data.numel(), device=data.device, pending=future)

    def copy_in(self, stored: Ticket, tier: Tier) -> Ticket:
        future = self._pool.submit(read_after_write, tier, stored.pending)
        return Ticket(nbytes=stored.nbytes, device=stored.device, pending=future, source=stored)

    def done(self, ticket: Ticket) -> bool:
        return ticket.pending.done()

    def wait(self, ticket: Ticket) -> torch.Tensor | None:
        value = ticket.pending.result()
        return value if ticket.source is not None else None

    def release(self, stored: Ticket, tier: Tier) -> None:
        free_when_written(tier, stored.pending)

    def close(self) -> None:
        self._pool.shutdown()
