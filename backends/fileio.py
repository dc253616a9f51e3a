"""Blocking file writes and reads of tensor bytes, in Python: the fallback of the native I/O engine.

``os.pwrite`` / ``os.preadv`` release the GIL while the kernel copies, so worker threads overlap
with compute. With ``direct=True`` (file opened with ``O_DIRECT``) every transfer must start at an
aligned address and offset and have an aligned length: writes go through a per-thread, page-aligned
bounce buffer (an anonymous ``mmap`` of 1 MiB); reads land directly in the caller's buffer, which the disk
tier allocates aligned and padded (``aligned_empty``). Without ``O_DIRECT`` the written range is
flushed (``fdatasync``) and dropped from the page cache (``posix_fadvise(DONTNEED)``) so memory
really drops. The native engine (``csrc/fileio.cpp``) does the same work without the GIL.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading

import torch

ALIGNMENT = 4096
"""Offsets, lengths and addresses of ``O_DIRECT`` transfers are multiples of this (a page)."""
BOUNCE_BYTES = 1 << 20
"""Per thread, kept once touched: small and steady (see csrc/fileio.cpp)."""

_bounce = threading.local()


def padded(nbytes: int) -> int:
    """``nbytes`` rounded up to ``ALIGNMENT``."""
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def aligned_empty(nbytes: int) -> torch.Tensor:
    """A 1-D ``uint8`` CPU tensor of ``padded(nbytes)`` bytes starting at an ``ALIGNMENT`` boundary."""
    raw = torch.empty(padded(nbytes) + ALIGNMENT, dtype=torch.uint8)
    shift = -raw.data_ptr() % ALIGNMENT
    return raw[shift:shift + padded(nbytes)]


def _view(tensor: torch.Tensor, start: int, length: int) -> memoryview:
    # A writable memoryview over a CPU tensor's bytes; the caller keeps the tensor alive.
    return memoryview((ctypes.c_char * length).from_address(tensor.data_ptr() + start)).cast("B")


def _bounce_buffer() -> mmap.mmap:
    buffer = getattr(_bounce, "buffer", None)
    if buffer is None:
        buffer = _bounce.buffer = mmap.mmap(-1, BOUNCE_BYTES)  # page-aligned by construction
    return buffer


def _drop_cache(fd: int, offset: int, length: int) -> None:
    os.fdatasync(fd)
    os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


class PythonFileIO:
    """The Python I/O path: blocking, thread-safe, same results as the native engine."""

    name = "python"

    def write(self, fd: int, data: torch.Tensor, offset: int, direct: bool) -> None:
        """Write the bytes of the contiguous 1-D ``uint8`` CPU tensor ``data`` at ``offset``."""
        nbytes = data.numel()
        if not direct:
            _write_all(fd, _view(data, 0, nbytes), offset)
            _drop_cache(fd, offset, nbytes)
            return
        bounce = memoryview(_bounce_buffer())
        done = 0
        while done < nbytes:
            chunk = min(BOUNCE_BYTES, nbytes - done)
            bounce[:chunk] = _view(data, done, chunk)
            aligned = padded(chunk)
            bounce[chunk:aligned] = bytes(aligned - chunk)
            _write_all(fd, bounce[:aligned], offset + done)
            done += chunk

    def read(self, fd: int, out: torch.Tensor, offset: int, direct: bool) -> None:
        """Fill ``out`` (1-D ``uint8``; aligned and padded when ``direct``) from ``offset``."""
        nbytes = out.numel()
        view = _view(out, 0, nbytes)
        done = 0
        while done < nbytes:
            count = os.preadv(fd, [view[done:]], offset + done)
            if count == 0:
                raise OSError(5, f"short read: {done} of {nbytes} bytes")  # EIO
            done += count
        if not direct:
            os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)


def _write_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)
