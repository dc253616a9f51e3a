"""The disk tier: saved tensors in private, already-unlinked files, bypassing the page cache.

Files: each is created in a fresh ``mkdtemp`` directory (mode 0700) with mode 0600, unlinked at once
and the directory removed, so the name exists for microseconds and a killed process leaves nothing on
disk; the space returns to the filesystem when the descriptor closes. Tensors get page-aligned
ranges of a chunk file (``file_bytes`` each): a freed range is reused by later tensors (first fit), a
freed tail is truncated away at once, a freed range inside is punched out (``fallocate``, where the
filesystem can), and a chunk whose tensors are all freed is truncated to zero
(the current one) or closed. So graphs dropped without backward (evaluation with grad on) give their
space back step by step, not only when a whole chunk empties.

Page cache: files are opened with ``O_DIRECT`` where the filesystem allows it (probed with one aligned
write); otherwise written ranges are flushed and dropped with ``posix_fadvise(DONTNEED)``, so the
memory really leaves the machine's RAM either way (``direct=False`` forces that path).

The byte I/O is done by the native engine or its Python fallback (``acshim.storage.native``).

fork: a child inherits the descriptors of its parent's chunk files, which share the parent's space.
The child never writes into, truncates or punches them: each tier starts a new chunk file in the
child (``os.register_at_fork``), and a parent's file is only read there (graphs made before the
fork) and closed when the child's last slot in it is freed.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import fcntl
import mmap
import os
import tempfile
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ..backends.fileio import ALIGNMENT, aligned_empty, padded
from .reaper import REAPER

_PUNCH_HOLE = 0x01 | 0x02  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE
_fallocate: Any = None


def punch_hole(fd: int, offset: int, size: int) -> bool:
    """Give ``[offset, offset + size)`` of a file back to the filesystem, keeping its size (Linux
    ``fallocate``). False where the platform or filesystem cannot; the range is reused anyway."""
    global _fallocate
    if _fallocate is None:
        try:
            function = ctypes.CDLL(None, use_errno=True).fallocate
            function.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
            _fallocate = function
        except (AttributeError, OSError):
            _fallocate = False
    return bool(_fallocate) and _fallocate(fd, _PUNCH_HOLE, offset, size) == 0


class _File:
    """One open, unlinked chunk file: slots below ``end``, freed ranges in ``holes`` (sorted
    ``[offset, size]``, coalesced, never touching ``end``)."""

    __slots__ = ("fd", "direct", "end", "live", "holes", "punch", "pid")

    def __init__(self, fd: int, direct: bool) -> None:
        self.fd, self.direct, self.end, self.live = fd, direct, 0, 0
        self.holes: list[list[int]] = []
        self.punch = True
        """False once the filesystem refused to punch a hole."""
        self.pid = os.getpid()
        """The process that created the file: only it may change the file (see fork above)."""

    def take_hole(self, size: int) -> int | None:
        """The offset of the first freed range that fits ``size`` bytes (now used), or None."""
        for i, hole in enumerate(self.holes):
            if hole[1] >= size:
                offset = hole[0]
                if hole[1] == size:
                    del self.holes[i]
                else:
                    hole[0] += size
                    hole[1] -= size
                return offset
        return None

    def give_back(self, offset: int, size: int) -> bool:
        """Record ``[offset, offset + size)`` as free; True if ``end`` moved down (the tail freed)."""
        holes = self.holes
        i = bisect.bisect_left(holes, [offset, 0])
        if i < len(holes) and offset + size == holes[i][0]:  # merge with the next hole
            size += holes.pop(i)[1]
        if i and holes[i - 1][0] + holes[i - 1][1] == offset:  # and with the previous one
            i -= 1
            offset, size = holes[i][0], holes.pop(i)[1] + size
        if offset + size == self.end:
            self.end = offset
            return True
        holes.insert(i, [offset, size])
        return False


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

    __slots__ = ("lock", "current", "__weakref__")

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.current: _File | None = None
        _all_chunks.add(self)

    def forked(self) -> None:
        """In a forked child: the parent's current file is not ours to grow; start a new one."""
        self.lock = threading.RLock()  # a parent thread may have held it at the fork
        file, self.current = self.current, None
        if file is not None and file.live == 0:
            os.close(file.fd)


_all_chunks: weakref.WeakSet[_Chunks] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for chunks in list(_all_chunks):
        chunks.forked()


os.register_at_fork(after_in_child=_after_fork_in_child)


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
        size = padded(nbytes)
        chunks = self._chunks
        with chunks.lock:
            file = chunks.current
            offset = file.take_hole(size) if file is not None else None
            if offset is None:
                if file is None or (file.end and file.end + size > self.file_bytes):
                    if file is not None and file.live == 0:
                        os.close(file.fd)
                    file = chunks.current = _File(*open_private_file(self.directory, self.want_direct))
                offset = file.end
                file.end += size
            file.live += 1
            return FileSlot(file, offset, nbytes)

    def write(self, data: torch.Tensor) -> FileSlot:
        slot = self._reserve(data.numel())
        try:
            self.io.write(slot.file.fd, data, slot.offset, slot.file.direct)
        except OSError:
            self.free(slot)
            raise
        return slot

    def read(self, slot: FileSlot) -> torch.Tensor:
        """The slot's bytes in a new CPU tensor."""
        out = aligned_empty(slot.nbytes) if slot.file.direct else torch.empty(slot.nbytes, dtype=torch.uint8)
        return self.read_into(slot, out)

    def read_into(self, slot: FileSlot, out: torch.Tensor) -> torch.Tensor:
        """Read the slot into ``out`` (1-D ``uint8``; page-aligned and at least ``padded(nbytes)``
        long when the file is ``O_DIRECT``, as a staging region is); returns its first bytes."""
        if slot.file.direct:
            self.io.read(slot.file.fd, out[:padded(slot.nbytes)], slot.offset, True)
        else:
            self.io.read(slot.file.fd, out[:slot.nbytes], slot.offset, False)
        return out[:slot.nbytes]

    def free(self, slot: FileSlot) -> None:
        """Free a slot: later slots reuse its range, and a freed tail goes back to the filesystem
        at once, so the space held follows the live tensors, not the chunk's history."""
        with self._chunks.lock:
            file = slot.file
            file.live -= 1
            if file.pid != os.getpid():  # a parent's file, in a forked child: never change it
                if file.live == 0:
                    os.close(file.fd)
                return
            if file.live:
                size = padded(slot.nbytes)
                if slot.offset + size < file.end and file.punch:  # before give_back: not yet reusable
                    file.punch = punch_hole(file.fd, slot.offset, size)
                if file.give_back(slot.offset, size):
                    os.ftruncate(file.fd, file.end)
                return
            if file is self._chunks.current:
                os.ftruncate(file.fd, 0)  # give the space back, keep the file for the next step
                file.end = 0
                file.holes.clear()
            else:
                os.close(file.fd)

    def close(self) -> None:
        """Close the current file if nothing in it is live (files with live tensors close when
        their last tensor is freed)."""
        _retire(self._chunks)
