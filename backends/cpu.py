"""CPU backend: worker threads run the tier's blocking writes and reads (host memory or disk files).

The forward/backward thread only submits work. Reads of a tensor are ordered after its write by
waiting on the write's future inside the worker; writes never wait on anything, and are always
submitted before their reads, so a FIFO pool cannot deadlock.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
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


def read_after_write(tier: Tier, written: Future[Any], pin_memory: bool = False) -> torch.Tensor:
    """Wait for the write that produced the slot (on this worker), then read the slot back."""
    return tier.read(written.result(), pin_memory)


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


class CpuBackend(Backend):
    """Moves CPU tensors to a tier with ``workers`` threads (the tier's I/O releases the GIL)."""

    def __init__(self, workers: int = 2) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="acshim-offload")
        _start_workers(self._pool, workers)

    def copy_out(self, data: torch.Tensor, tier: Tier) -> Ticket:
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
        self._pool.shutdown(wait=True)
