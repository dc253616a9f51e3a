"""acshim's CPU tensor allocator: a budget's memory at the speed of a cache (``csrc/host_cache.cpp``).

``acshim run --budget`` fixes glibc's mmap threshold at 64 KiB (``acshim.allocator``) so that the
process's resident memory follows what tensors hold; every activation then costs a fresh mapping,
its page faults and an ``munmap``, every step (a planned step ran at twice the time of the same
recipe without it). This allocator, made torch's CPU allocator (``c10::SetCPUAllocator``), maps
blocks of 64 KiB and more itself and, once the plan is made, keeps freed blocks for requests of their
size, bounded as the CUDA caching allocator's reserved memory is not: what it maps never exceeds the
most its tensors held at once since the last ``release()``. The process therefore holds no more than
with a mapping per tensor (but for buffers allocated well before they are written: a cached block is
resident when handed out, a fresh mapping as it is written), and steps that repeat their sizes are
served from the cache.

What it keeps free is the planner's to account for, as a GPU's reserved memory is
(``planner.process``): ``cached()`` is left out of the process's reading, and ``release()`` gives it
back and resets the bound wherever a measurement starts (``planner.process.trim``).

Compiled on first use like the disk tier's engine (``storage.native``); where it cannot be built,
or with ``ACSHIM_HOST_CACHE=0``, torch's allocator stays and the mmap threshold alone holds the
budget (slower). Blocks it made and freed after ``uninstall()`` are unmapped as they are freed.
"""

from __future__ import annotations

import os
import threading
import warnings
from types import ModuleType
from typing import Any

ENVIRONMENT_VARIABLE = "ACSHIM_HOST_CACHE"
SOURCES = ("host_cache.cpp",)

_lock = threading.Lock()
_state: dict[str, Any] = {"module": None, "attempted": False, "reason": "not loaded", "installed": False}


def _forced_off() -> bool:
    return os.environ.get(ENVIRONMENT_VARIABLE, "").lower() in ("0", "off", "false", "no")


def _load() -> ModuleType | None:
    with _lock:
        if _state["attempted"]:
            return _state["module"]
        _state["attempted"] = True
        if _forced_off():
            _state["reason"] = f"turned off by {ENVIRONMENT_VARIABLE}={os.environ[ENVIRONMENT_VARIABLE]}"
            return None
        from .storage.native import compile_extension

        try:
            _state["module"] = compile_extension("acshim_host_cache", SOURCES)
            _state["reason"] = "compiled extension loaded"
        except Exception as error:  # any toolchain failure: torch's allocator and the mmap threshold stay
            _state["reason"] = f"build failed: {type(error).__name__}: {str(error).strip().splitlines()[-1:]}"
            warnings.warn(f"acshim: the CPU tensor cache is unavailable ({_state['reason']}); planned steps map "
                          "every activation afresh (the budget holds, steps are slower)", RuntimeWarning,
                          stacklevel=3)
        return _state["module"]


def install() -> bool:
    """Make acshim's allocator torch's CPU allocator, mapping each block of 64 KiB or more on its own
    and caching nothing yet (what the mmap threshold gives); False where it could not be (not built,
    turned off, or another allocator set at a higher priority)."""
    module = _load()
    if module is None:
        return False
    _state["installed"] = bool(module.install())
    if not _state["installed"]:
        _state["reason"] = "another CPU allocator is set at a higher priority"
    return _state["installed"]


def installed() -> bool:
    return bool(_state["installed"])


def enable_cache() -> bool:
    """Keep freed blocks from now on (mapped bytes bounded by the most held since); False where the
    allocator is not installed."""
    if not _state["installed"]:
        return False
    _state["module"].enable_cache(0)
    return True


def caching() -> bool:
    return bool(_state["installed"]) and bool(_state["module"].caching())


def cached() -> int:
    """Bytes of freed blocks the cache keeps mapped (resident): 0 where it is not installed."""
    return int(_state["module"].cached()) if _state["installed"] else 0


def release() -> int:
    """Unmap every cached block and bound the cache by what tensors hold from now; returns the bytes
    given back (0 where it is not installed)."""
    return int(_state["module"].release()) if _state["installed"] else 0


def stats() -> dict[str, int]:
    """The allocator's counters: ``allocated`` / ``peak_allocated`` (bytes tensors hold), ``mapped`` /
    ``peak_mapped`` (large blocks mapped, held and cached), ``cached``, ``bound``, ``hits``,
    ``misses``, ``maps``, ``unmaps``; empty where it is not installed."""
    return dict(_state["module"].stats()) if _state["installed"] else {}


def uninstall() -> None:
    """Restore torch's CPU allocator and unmap the cache (the planner's session calls it when it
    stops: at the end of ``acshim run --budget``, or where the run is refused)."""
    if _state["installed"]:
        _state["module"].uninstall()
        _state["installed"] = False


def build() -> str:
    """Compile the allocator now (``acshim build-ext``); raises ``RuntimeError`` where it cannot be."""
    if _load() is None:
        raise RuntimeError(f"acshim's CPU tensor allocator did not build: {_state['reason']}")
    return status()


def status() -> str:
    """One line for ``acshim doctor``."""
    if _state["installed"]:
        return f"installed ({'caching' if caching() else 'mapping per tensor'})"
    if not _state["attempted"] and not _forced_off():
        return (f"not loaded in this process (acshim run --budget compiles and installs it; "
                f"{ENVIRONMENT_VARIABLE}=0 keeps torch's)")
    return f"not installed ({_state['reason']})"
