"""CUDA backend: copies on a side stream into pinned host memory, ordered with CUDA events.

Out: the side stream waits for the compute stream (so it reads finished values), copies device ->
pinned host with ``non_blocking=True``, and ``record_stream`` keeps the device memory from being
reused before the copy has read it. Host tier: the pinned buffer is the slot. Disk tier: a CPU
worker waits for the copy's event, then writes the pinned buffer to the tier.
In: pinned host -> device on the side stream; ``wait`` makes the *current* stream wait for the
copy's event (the CPU does not block) and ``record_stream`` ties the new tensor to that stream.

Not runnable on the CPU-only machine this project is developed on: kept small, typed and reviewed;
no GPU figure is claimed anywhere for it. Mirrors the stream discipline of torchtune's
``OffloadActivations`` (use_streams=True) without its per-node hooks.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from .base import Backend, Ticket, Tier
from .cpu import CpuBackend, free_when_written, write_from


def _write_after(event: torch.cuda.Event, tier: Tier, holder: list[torch.Tensor]) -> object:
    event.synchronize()
    return write_from(tier, holder)


def _read_then_upload(tier: Tier, written: Future[object], device: torch.device,
                      stream: torch.cuda.Stream) -> tuple[torch.Tensor, torch.cuda.Event]:
    host = tier.read(written.result(), True)
    with torch.cuda.stream(stream):
        result = torch.empty(host.numel(), dtype=torch.uint8, device=device)
        result.copy_(host, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    return result, event


class CudaBackend(Backend):
    """Transfers for tensors on one CUDA device."""

    def __init__(self, device: torch.device, workers: int = 2) -> None:
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)
        self._disk_io = CpuBackend(workers)

    def copy_out(self, data: torch.Tensor, tier: Tier) -> Ticket:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        host = torch.empty(data.numel(), dtype=torch.uint8, pin_memory=True)
        with torch.cuda.stream(self.stream):
            host.copy_(data, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        data.record_stream(self.stream)
        ticket = Ticket(nbytes=data.numel(), device=data.device)
        if tier.kind == "host":
            ticket.slot, ticket.pending = tier.write(host), event
        else:
            ticket.pending = self._disk_io._pool.submit(_write_after, event, tier, [host])
        return ticket

    def copy_in(self, stored: Ticket, tier: Tier) -> Ticket:
        ticket = Ticket(nbytes=stored.nbytes, device=stored.device, source=stored)
        if isinstance(stored.pending, Future):  # disk: a worker reads, then uploads
            ticket.pending = self._disk_io._pool.submit(_read_then_upload, tier, stored.pending,
                                                        self.device, self.stream)
            return ticket
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(stored.pending)
            ticket.result = torch.empty(stored.nbytes, dtype=torch.uint8, device=self.device)
            ticket.result.copy_(tier.read(stored.slot), non_blocking=True)
            ticket.pending = torch.cuda.Event()
            ticket.pending.record(self.stream)
        return ticket

    def done(self, ticket: Ticket) -> bool:
        if isinstance(ticket.pending, Future):
            if not ticket.pending.done():
                return False
            if ticket.source is None:
                return True
            return ticket.pending.result()[1].query()
        return ticket.pending.query()

    def wait(self, ticket: Ticket) -> torch.Tensor | None:
        if isinstance(ticket.pending, Future):
            value = ticket.pending.result()
            if ticket.source is None:
                return None
            ticket.result, ticket.pending = value
        current = torch.cuda.current_stream(self.device)
        current.wait_event(ticket.pending)
        if ticket.result is None:
            return None
        ticket.result.record_stream(current)
        return ticket.result

    def release(self, stored: Ticket, tier: Tier) -> None:
        if isinstance(stored.pending, Future):
            free_when_written(tier, stored.pending)
        else:
            tier.free(stored.slot)
            stored.slot = None

    def close(self) -> None:
        self._disk_io.close()
