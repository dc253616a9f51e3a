"""The process's resident set, its high-water mark, and a reset of both (docs/measuring.md): the budget
tests paste this file's text into the probe scripts they run in fresh processes. ``rss()`` leaves out
the freed blocks acshim's CPU allocator keeps for reuse under ``acshim run --budget``
(``acshim.host_allocator.cached``): what tensors hold, not what the cache keeps; the high-water mark
counts everything."""

import ctypes
import os
import sys


def rss():
    with open("/proc/self/statm") as f:
        resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    allocator = sys.modules.get("acshim.host_allocator")
    return resident - (allocator.cached() if allocator is not None else 0)


def hwm():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def reset():
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
