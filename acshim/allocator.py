"""The process's C allocator, set so that its resident memory follows what tensors hold.

glibc's malloc serves an allocation over ``M_MMAP_THRESHOLD`` with its own mapping, returned to the
system when freed, but by default it raises that threshold to the size of every mapped block freed
(up to 32 MiB): after the first steps, activation-sized tensors come from the heap, whose freed
pages stay resident. A budget planned against tensors is then not the memory the process holds.
``mallopt(M_MMAP_THRESHOLD, 65536)`` fixes the threshold at 64 KiB and turns that adjustment off,
the same setting as ``MALLOC_MMAP_THRESHOLD_=65536`` (glibc manual, "Memory Allocation Tunables";
mallopt(3)). ``acshim run --budget`` and ``acshim plan`` make this call before torch is imported;
``acshim.plan`` makes it when called. Nothing is done on a C library without ``mallopt`` (macOS,
musl), nor where the user set ``MALLOC_MMAP_THRESHOLD_`` (theirs is kept).

On a CUDA device the same holds for the caching allocator: by default it keeps freed blocks in
fixed-size segments, so what it reserves (the memory an out-of-memory error and ``nvidia-smi``
count) can run far above what tensors hold, differently from run to run. With
``expandable_segments:True`` (PyTorch's "CUDA memory management" notes) a segment grows and shrinks
by pages as tensors need, so reserved memory follows allocated memory. ``own()`` sets it through
``PYTORCH_CUDA_ALLOC_CONF`` before CUDA starts (and through
``torch.cuda.memory._set_allocator_settings`` where torch is imported already), unless the user
configured the allocator (``PYTORCH_CUDA_ALLOC_CONF`` or ``PYTORCH_ALLOC_CONF``: theirs is kept).

This module imports nothing heavy: ``acshim/__init__`` runs it before it imports torch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_MMAP_THRESHOLD = -3  # glibc malloc.h
THRESHOLD = 65536
_ENV = "MALLOC_MMAP_THRESHOLD_"
CUDA_SETTING = "expandable_segments:True"
_CUDA_ENVS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")

_state: dict[str, str] = {}


def own() -> str:
    """Fix the mmap threshold at 64 KiB (once per process); returns how the allocator is set:
    ``"mallopt"`` (this call or an earlier one set it), ``"environment"`` (the user's
    ``MALLOC_MMAP_THRESHOLD_`` is kept) or ``"unavailable"`` (no glibc ``mallopt``)."""
    if "how" in _state:
        return _state["how"]
    if os.environ.get(_ENV):
        how = "environment"
    else:
        how = "mallopt" if _mallopt(M_MMAP_THRESHOLD, THRESHOLD) else "unavailable"
    _state["how"] = how
    _state["cuda"] = _own_cuda_allocator()
    return how


def how_set() -> str | None:
    """What :func:`own` returned in this process, or None where it was not called."""
    return _state.get("how")


def cuda_how_set() -> str | None:
    """How :func:`own` left the CUDA caching allocator: ``"expandable"`` (it set
    ``expandable_segments:True``), ``"user"`` (the user's ``PYTORCH_CUDA_ALLOC_CONF`` /
    ``PYTORCH_ALLOC_CONF`` is kept), or None where ``own`` was not called."""
    return _state.get("cuda")


def _own_cuda_allocator() -> str:
    if any(os.environ.get(name) for name in _CUDA_ENVS):
        return "user"
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = CUDA_SETTING  # read when CUDA starts (and by child processes)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():  # imported already: the environment may be read
        # torch 2.9 and later name the setter for every accelerator (the CUDA one warns it is deprecated)
        setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
        try:
            setter(CUDA_SETTING)
        except (AttributeError, RuntimeError):  # a torch without the runtime setter: the variable stands
            pass
    return "expandable"


def _mallopt(param: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt(param, value) == 1


def invoked_as_budget_command(argv: list[str] | None = None) -> bool:
    """Whether this process is ``acshim run --budget ...``, ``acshim plan ...`` (console script,
    ``python -m acshim`` or a launcher's ``-m acshim``), read from the interpreter's own command line."""
    args = list(getattr(sys, "orig_argv", sys.argv) if argv is None else argv)
    rest: list[str] | None = None
    for index, arg in enumerate(args):
        if arg == "-m" and index + 1 < len(args) and args[index + 1] == "acshim":
            rest = args[index + 2:]
            break
        if os.path.basename(arg) == "acshim" and index <= 1:
            rest = args[index + 1:]
            break
    if rest is None:
        return False
    while rest and rest[0].startswith(("--local_rank=", "--local-rank=")):
        rest = rest[1:]
    if not rest or rest[0] not in ("run", "plan"):
        return False
    if rest[0] == "plan":
        return True
    for arg in rest[1:]:
        if arg == "--" or not arg.startswith("-"):
            return False  # the script and its own arguments begin
        if arg == "--budget" or arg.startswith("--budget="):
            return True
    return False
