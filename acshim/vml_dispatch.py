"""Settle oneMKL's vector-math dispatch on one thread before any tensor work runs.

torch's CPU wheels compute ``exp``, ``log``, ``sin``, ``cos``... of float tensors with oneMKL's VML
(``ATen/cpu/vml.h``), one call per ``at::parallel_for`` chunk (grain 2048). VML picks its code path
on its first call in the process; when that first call is made by two intra-op threads at once (a
tensor of more than 2,048 elements and two threads), one chunk can be computed on another path
whose last bits differ. Measured on an AVX-512/AMX Xeon with torch 2.13.0, two threads: the first
``cos`` of a 1x121x32 rotary table (a Llama's step 1) differs from every later one in 10 of 40 fresh
processes; ``exp`` 5 of 16, ``sin`` 2 of 16, ``log`` 1 of 16. One call on one element first (the
main thread alone) settles the dispatch: 0 of 80. acshim does that call when it is imported, so a
script run under acshim computes these kernels the same way on every step and in every process.
Written by hand because neither torch nor oneMKL exposes the dispatch (``MKL_CBWR`` would fix it
too, but only as an environment variable set before the process starts).
"""

from __future__ import annotations

import torch

_settled = False


def settle() -> None:
    """Make oneMKL's VML choose its code path now, on this thread alone (once per process)."""
    global _settled
    if not _settled:
        torch.ones(1).exp()
        _settled = True
