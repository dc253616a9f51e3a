"""A test backend that simulates transfer time, so prefetch overlap is measurable on a CPU.

Each copy sleeps ``seconds_per_byte * nbytes`` in a worker thread before doing the real (CPU) tier
write or read, on one worker by default: transfers queue up like copies over one link. Sleeping
does not use the CPU, so compute overlaps it exactly as it would overlap a DMA transfer. Every
transfer is logged with its start and end time (``time.perf_counter``).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from .base import Ticket, Tier
from .cpu import CpuBackend, read_after_write, write_keeping_data


@dataclass(frozen=True)
class TransferRecord:
    """One simulated transfer: ``"out"`` or ``"in"``, its size and wall-clock interval."""

    direction: str
    nbytes: int
    start: float
    end: float


class SimulatedBackend(CpuBackend):
    """``CpuBackend`` whose copies take ``seconds_per_byte`` per byte (e.g. ``1 / 2e9`` for 2 GB/s)."""

    def __init__(self, seconds_per_byte: float, workers: int = 1) -> None:
        if seconds_per_byte < 0:
            raise ValueError(f"seconds_per_byte must be >= 0, got {seconds_per_byte}")
        self.seconds_per_byte = seconds_per_byte
        self.log: list[TransferRecord] = []
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="acshim-simulated")

    def _timed(self, direction: str, nbytes: int, work: Any, *args: Any) -> Any:
        start = time.perf_counter()
        time.sleep(self.seconds_per_byte * nbytes)
        result = work(*args)
        with self._lock:
            self.log.append(TransferRecord(direction, nbytes, start, time.perf_counter()))
        return result

    def copy_out(self, data: torch.Tensor, tier: Tier) -> Ticket:
        future = self._pool.submit(self._timed, "out", data.numel(), write_keeping_data, tier, data)
        return Ticket(nbytes=data.numel(), device=data.device, pending=future)

    def copy_in(self, stored: Ticket, tier: Tier) -> Ticket:
        written: Future[Any] = stored.pending
        future = self._pool.submit(self._timed, "in", stored.nbytes, read_after_write, tier, written)
        return Ticket(nbytes=stored.nbytes, device=stored.device, pending=future, source=stored)

    def transfer_seconds(self, direction: str = "in") -> float:
        """Total simulated time of the logged transfers in ``direction``."""
        return sum(r.end - r.start for r in self.log if r.direction == direction)
