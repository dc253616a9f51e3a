"""The CUDA runtime the CUDA backend runs on, as one small injectable object.

``CudaBackend`` touches CUDA only through this object: streams, events, the current stream, the
stream context, the device guard, the capture state, page-locked host memory, device allocation,
asynchronous copies and ``record_stream``. ``TorchCudaRuntime`` is the real one (``torch.cuda``); ``SimulatedCuda``
(``backends/simcuda.py``) replays the same calls on CPU tensors with a happens-before checker, so the
backend's stream ordering is tested on a machine without a GPU.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

HOST_REGISTER_PORTABLE = 1
"""``cudaHostRegisterPortable``: the memory counts as pinned for every CUDA context, not only the
registering device's (without it copies for another device become staged synchronous copies)."""


class CudaRuntime(Protocol):
    """What ``CudaBackend`` needs from CUDA (names as ``torch.cuda``'s where it has them)."""

    def Stream(self, device: torch.device) -> Any:
        """A new stream with ``wait_event``, ``wait_stream``, ``synchronize`` and ``query``."""

    def Event(self) -> Any:
        """A new event with ``record(stream)``, ``synchronize`` and ``query``."""

    def current_stream(self, device: torch.device) -> Any:
        """The calling thread's current stream on ``device``."""

    def stream(self, stream: Any) -> AbstractContextManager[Any]:
        """Make ``stream`` current inside the block (this thread)."""

    def device(self, device: torch.device) -> AbstractContextManager[Any]:
        """Make ``device`` the calling thread's current device inside the block."""

    def is_capturing(self, device: torch.device) -> bool:
        """True while the current stream is capturing a CUDA graph."""

    def is_device_tensor(self, tensor: torch.Tensor, device: torch.device) -> bool:
        """True if ``tensor`` is memory of ``device`` (what the backend may move)."""

    def pin(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of page-locked (portable), page-aligned host memory as a 1-D ``uint8`` tensor."""

    def unpin(self, tensor: torch.Tensor) -> None:
        """Give back memory from ``pin``."""

    def empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A 1-D ``uint8`` device tensor, allocated on the current stream."""

    def copy(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        """``destination.copy_(source, non_blocking=True)`` on the current stream."""

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """``tensor.record_stream(stream)``: its memory is not reused before ``stream``'s work."""


class TorchCudaRuntime:
    """The real runtime: ``torch.cuda``. Pinned memory is registered with ``cudaHostRegister``
    rather than taken from torch's host allocator, which rounds each request up to a power of two
    and keeps every block it ever handed out (a pool of slabs would pin up to twice its size).

    Args:
        cudart: the CUDA runtime bindings (default ``torch.cuda.cudart()``; tests pass a fake).
        clear_error: clears the runtime's last error after a failed registration, so an unrelated
            later call does not report it (default: ``cudaGetLastError`` of the loaded libcudart).
    """

    def __init__(self, cudart: Any = None, clear_error: Callable[[], object] | None = None) -> None:
        self._cudart, self._clear_error = cudart, clear_error if clear_error is not None else clear_cuda_error

    def Stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.Stream(device)

    def Event(self) -> torch.cuda.Event:
        return torch.cuda.Event()

    def current_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.current_stream(device)

    def stream(self, stream: torch.cuda.Stream) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def device(self, device: torch.device) -> AbstractContextManager[Any]:
        return torch.cuda.device(device)

    def is_capturing(self, device: torch.device) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def is_device_tensor(self, tensor: torch.Tensor, device: torch.device) -> bool:
        return tensor.device == device

    def cudart(self) -> Any:
        return self._cudart if self._cudart is not None else torch.cuda.cudart()

    def pin(self, nbytes: int) -> torch.Tensor:
        # An anonymous mapping: page-aligned (O_DIRECT reads land in it) and exactly nbytes long.
        tensor = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)
        error = int(self.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, HOST_REGISTER_PORTABLE))
        if error != 0:
            self._clear_error()  # else the next unrelated CUDA call (a kernel launch check) reports it
            raise RuntimeError(f"acshim offload: page-locking {nbytes} bytes of host memory failed (cudaError "
                               f"{error}); lower the offload's in-flight bytes or free host memory")
        return tensor

    def unpin(self, tensor: torch.Tensor) -> None:
        self.cudart().cudaHostUnregister(tensor.data_ptr())

    def empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def copy(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        destination.copy_(source, non_blocking=True)

    def record_stream(self, tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        tensor.record_stream(stream)


def clear_cuda_error() -> None:
    """``cudaGetLastError()`` of the libcudart this process loaded (torch's), if one is found."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line}
    except OSError:
        paths = set()
    for path in sorted(paths):
        try:
            ctypes.CDLL(path).cudaGetLastError()  # dlopen of a loaded library: the same runtime
        except (OSError, AttributeError):
            continue
        return
