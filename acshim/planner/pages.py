"""Memory an allocation commits on the CPU, as opposed to the bytes it asks for.

A factory that allocates without writing (``torch.empty`` and kin) commits no pages on the CPU
until they are written: glibc maps a block over the mmap threshold and the kernel backs it page by
page. TRL's chunked log-prob (``trl/kernels/chunked_logprob.py``) allocates a 960 x 32768 float32
scratch buffer (120 MiB) and writes a vocabulary-wide column slice of it (a 512-token vocabulary:
one page per row, under 8 MiB). Counted by what they ask for, such buffers made a whole-step
prediction 120 MiB too high and refused every fraction of that SFT script. Their bytes are counted
by the pages resident in them instead (``mincore(2)``), measured when they are created and after
every operator that uses them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import sys
from typing import Any

import torch

UNINITIALISED = frozenset(("empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like"))
"""ATen factories whose outputs are allocated and not written."""

SMALLEST = 1 << 20
"""Below this a block comes from a heap page already in use: counted as asked."""


def uncommitted(func: Any, args: Any, kwargs: Any) -> bool:
    """Whether ``func`` allocates CPU memory without writing it (on Linux, where pages can be read)."""
    if getattr(func, "_opname", None) not in UNINITIALISED or _mincore() is None:
        return False
    device = (kwargs or {}).get("device")
    if device is None:
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.get_default_device())
    return torch.device(device).type == "cpu"


def resident_bytes(storage: torch.UntypedStorage) -> int:
    """Bytes of ``storage``'s pages the kernel has resident (whole pages, so at most one page more
    per end); its ``nbytes()`` where that cannot be read."""
    size = storage.nbytes()
    mincore = _mincore()
    if mincore is None or size < SMALLEST or storage.device.type != "cpu":
        return size
    page = mmap.PAGESIZE
    start = storage.data_ptr() // page * page
    length = storage.data_ptr() + size - start
    pages = (length + page - 1) // page
    vector = (ctypes.c_ubyte * pages)()
    if mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vector) != 0:
        return size
    return min(size, (pages - bytes(vector).count(0)) * page)


@functools.cache
def _mincore() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).mincore
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    function.restype = ctypes.c_int
    return function
