"""Transfer engines under the storage tier: one small interface, a backend per device kind.

``Backend`` (``base.py``) is the interface: note where saved bytes are made, issue a copy out, issue a
copy in, wait, release. ``CpuBackend`` moves CPU tensors with worker threads (host memory, disk
files); ``CudaBackend`` with two side streams ordered by events and pinned pools (``pinned.py``), on
an injectable CUDA runtime (``runtime.py``: ``torch.cuda``, or ``simcuda.SimulatedCuda``, which
checks its stream ordering on a CPU); ``SimulatedBackend`` (tests, benchmarks) models a link of a
given bandwidth (each copy lands at a per-byte deadline) so prefetch overlap can be measured on a
CPU. ``backend_for`` picks by device.
"""

from __future__ import annotations

import os
import threading

import torch

from .base import Backend, Ticket, Tier, TransferFailed
from .cpu import CpuBackend
from .simulated import SimulatedBackend, TransferRecord

_lock = threading.Lock()
_shared: dict[torch.device, Backend] = {}


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # another thread may have held it at the fork


os.register_at_fork(after_in_child=_after_fork_in_child)


def backend_for(device: torch.device) -> Backend:
    """The process-wide backend for ``device`` (created on first use): ``cpu`` -> ``CpuBackend``,
    ``cuda:N`` -> ``CudaBackend``. Other device kinds raise ``NotImplementedError``."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _lock:
        backend = _shared.get(device)
        if backend is None:
            if device.type == "cpu":
                backend = CpuBackend()
            elif device.type == "cuda":
                from .cuda import CudaBackend

                backend = CudaBackend(device)
            else:
                raise NotImplementedError(
                    f"acshim offload has no transfer backend for {device.type!r} tensors yet; "
                    "use storage='host' on CPU/CUDA or keep this region out of offload with acshim.storage.no_offload()")
            _shared[device] = backend
        return backend


__all__ = ["Backend", "CpuBackend", "SimulatedBackend", "Ticket", "Tier", "TransferFailed", "TransferRecord",
           "backend_for"]
