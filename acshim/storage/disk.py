"""The disk tier: saved tensors in private, already-unlinked files, bypassing the page cache.

Files: each is created in a fresh ``mkdtemp`` directory (mode 0700) with mode 0600, unlinked at once
and the directory removed, so the name exists for microseconds and a killed process leaves nothing on
disk; the space returns to the filesystem when the descriptor closes. Tensors are appended at
page-aligned offsets to a chunk file (``file_bytes`` each); a chunk whose tensors are all freed is
truncated and reused (the current one) or closed.

Page cache: files are opened with ``O_DIRECT`` where the filesystem allows it (probed with one aligned
write); otherwise written ranges are flushed and dropped with ``posix_fadvise(DONTNEED)``, so the
memory really leaves the machine's RAM either way (``direct=False`` forces that path).

The byte I/O is done by the native engine or its Python fallback (``acshim.storage.native``).
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import tempfile
import threading
from dataclasses import dataclass
from typing import Any

import torch

from ..backends.fileio import ALIGNMENT, aligned_empty, padded
from .reaper import REAPER


class _File:
    """One open, unlinked chunk file."""

    __slots__ = ("fd", "direct", "end", "live")

    def __init__(self, fd: int, direct: bool) -> None:
        self.fd, self.direct, self.end, self.live = fd, direct, 0, 0


@dataclass(frozen=True)
class FileSlot:
    """Where one tensor's bytes are: a file, an aligned offset, a length."""

    file: _File
    offset: int
    nbytes: int


def check_directory(directory: str | None) -> str:
    """The base directory for private files; ``ValueError`` if it is not a writable directory."""
    base = directory if directory is not None else tempfile.gettempdir()
    if not os.path.isdir(base):
        raise ValueError(f"directory={base!r} is not an existing directory; create it or pass another "
                         "directory= for the disk tier's private files")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ValueError(f"directory={base!r} is not writable; pass a writable directory= for the disk tier")
    return base


def _probe_direct(fd: int) -> bool:
    # Some filesystems accept O_DIRECT at open and reject it at the first write: try one aligned page.
    page = mmap.mmap(-1, ALIGNMENT)
    try:
        os.pwrite(fd, memoryview(page), 0)
        return True
    except OSError as error:
        if error.errno != errno.EINVAL:
            raise
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        return False
    finally:
        page.close()
        os.ftruncate(fd, 0)


def open_private_file(base: str, direct: bool) -> tuple[int, bool]:
    """Open a new unlinked file under ``base``; returns (fd, whether O_DIRECT is on)."""
    private = tempfile.mkdtemp(prefix="acshim-offload-", dir=base)  # mode 0700
    try:
        path = os.path.join(private, "saved-tensors")
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        fd = -1
        if direct:
            try:
                fd = os.open(path, flags | os.O_DIRECT, 0o600)
            except OSError as error:
                if error.errno != errno.EINVAL:
                    raise
                direct = False
        if fd < 0:
            fd = os.open(path, flags, 0o600)
        os.unlink(path)
    finally:
        os.rmdir(private)
    if direct:
        direct = _probe_direct(fd)
    return fd, direct


class _Chunks:
    """A tier's chunk files and lock; the reaper closes the current one when the tier dies."""

    __slots__ = ("lock", "current")

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.current: _File | None = None


def _retire(chunks: _Chunks) -> None:
    """Close the current chunk if nothing in it is live (files with live tensors close when their
    last tensor is freed)."""
    with chunks.lock:
        file, chunks.current = chunks.current, None
        if file is not None and file.live == 0:
            os.close(file.fd)


class DiskTier:
    """Private files for saved tensors. Thread-safe; ``io`` is a ``PythonFileIO``/``NativeFileIO``."""

    kind = "disk"
    max_bytes_in_flight = 8 << 20
    """Bytes waiting to be written before forward waits: small, so host memory really drops even
    when the disk is slower than forward (the session's back-pressure)."""

    def __init__(self, io: Any, directory: str | None = None, direct: bool | None = None,
                 file_bytes: int = 1 << 30) -> None:
        self.io = io
        self.directory = check_directory(directory)
        self.want_direct = direct is not False
        self.file_bytes = file_bytes
        self._chunks = _Chunks()
        # Not __del__: a Ctrl-C landing in it would be swallowed (see ``reaper``).
        REAPER.watch(self, _retire, self._chunks)

    @property
    def _current(self) -> _File | None:
        return self._chunks.current

    def _reserve(self, nbytes: int) -> FileSlot:
        chunks = self._chunks
        with chunks.lock:
            file = chunks.current
            if file is None or (file.end and file.end + padded(nbytes) > self.file_bytes):
                if file is not None and file.live == 0:
                    os.close(file.fd)
                file = chunks.current = _File(*open_private_file(self.directory, self.want_direct))
            slot = FileSlot(file, file.end, nbytes)
            file.end += padded(nbytes)
            file.live += 1
            return slot

    def write(self, data: torch.Tensor) -> FileSlot:
        slot = self._reserve(data.numel())
        try:
            self.io.write(slot.file.fd, data, slot.offset, slot.file.direct)
        except OSError:
            self.free(slot)
            raise
        return slot

    def read(self, slot: FileSlot, pin_memory: bool = False) -> torch.Tensor:
        if slot.file.direct:
            out = aligned_empty(slot.nbytes, pin_memory)
            self.io.read(slot.file.fd, out, slot.offset, True)
            return out[:slot.nbytes]
        out = torch.empty(slot.nbytes, dtype=torch.uint8, pin_memory=pin_memory)
        self.io.read(slot.file.fd, out, slot.offset, False)
        return out

    def free(self, slot: FileSlot) -> None:
        with self._chunks.lock:
            file = slot.file
            file.live -= 1
            if file.live:
                return
            if file is self._chunks.current:
                os.ftruncate(file.fd, 0)  # give the space back, keep the file for the next step
                file.end = 0
            else:
                os.close(file.fd)

    def close(self) -> None:
        """Close the current file if nothing in it is live (files with live tensors close when
        their last tensor is freed)."""
        _retire(self._chunks)
