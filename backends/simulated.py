"""A test backend that simulates transfer time, so prefetch overlap is measurable on a CPU.

Latency only: it models no streams and no ordering (``backends/simcuda.py`` does, behind the real
``CudaBackend``). Tests say which of the two they use.

It models one DMA link of ``1 / seconds_per_byte`` bytes per second: each copy is queued behind the
previous one on the link and *finishes at a deadline* (start + ``nbytes * seconds_per_byte``), like
a real transfer that needs no CPU. ``done`` compares the clock with the deadline; ``wait`` sleeps
until it. The tier's real write/read runs when the copy is issued (a no-op for the host tier).
Deadlines, rather than sleeping worker threads, keep the simulation exact when other processes load
the CPU: a sleeping thread may be woken late, a deadline is not. Every transfer is logged.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from .base import Backend, Ticket, Tier, TransferFailed


@dataclass(frozen=True)
class TransferRecord:
    """One simulated transfer: ``"out"`` or ``"in"``, its size and its interval on the link."""

    direction: str
    nbytes: int
    start: float
    end: float


class SimulatedBackend(Backend):
    """Copies that take ``seconds_per_byte`` per byte on one link (e.g. ``1 / 2e9`` for 2 GB/s)."""

    def __init__(self, seconds_per_byte: float) -> None:
        if seconds_per_byte < 0:
            raise ValueError(f"seconds_per_byte must be >= 0, got {seconds_per_byte}")
        self.seconds_per_byte = seconds_per_byte
        self.log: list[TransferRecord] = []
        self._link_free_at = 0.0
        self._lock = threading.Lock()

    def _schedule(self, direction: str, nbytes: int) -> float:
        with self._lock:
            start = max(time.perf_counter(), self._link_free_at)
            end = self._link_free_at = start + nbytes * self.seconds_per_byte
            self.log.append(TransferRecord(direction, nbytes, start, end))
            return end

    def copy_out(self, data: torch.Tensor, tier: Tier, ready: Any = None) -> Ticket:
        ticket = Ticket(nbytes=data.numel(), device=data.device, pending=self._schedule("out", data.numel()))
        try:
            ticket.slot = tier.write(data)
        except OSError as error:
            ticket.extra["failure"] = TransferFailed(error, data)
        return ticket

    def copy_in(self, stored: Ticket, tier: Tier) -> Ticket:
        ticket = Ticket(nbytes=stored.nbytes, device=stored.device, source=stored,
                        pending=max(self._schedule("in", stored.nbytes), stored.pending))
        if "failure" not in stored.extra:
            ticket.result = tier.read(stored.slot)
        return ticket

    def done(self, ticket: Ticket) -> bool:
        return time.perf_counter() >= ticket.pending

    def wait(self, ticket: Ticket) -> torch.Tensor | None:
        remaining = ticket.pending - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        failure = (ticket.source or ticket).extra.get("failure")
        if failure is not None:
            raise failure
        return ticket.result

    def release(self, stored: Ticket, tier: Tier) -> None:
        if "failure" not in stored.extra:
            tier.free(stored.slot)

    def transfer_seconds(self, direction: str = "in") -> float:
        """Total link time of the logged transfers in ``direction``."""
        return sum(r.end - r.start for r in self.log if r.direction == direction)
