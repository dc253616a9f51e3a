"""oneMKL's vector math chooses its code path on its first call; acshim settles it when imported
(``acshim.vml_dispatch``), so that a script's first ``exp``/``cos`` of more than 2,048 floats, split
between two intra-op threads, computes the bits every later call computes. On an AVX-512/AMX Xeon
without it, 5 of 16 fresh processes got other last bits from their first ``exp`` (and the rotary
``cos`` of a Llama's step 1 made ``acshim run --budget`` differ from the plain run); on a CPU where
the first call never races, this test passes with or without the fix. Fresh interpreters, because
the dispatch is settled once per process."""

from __future__ import annotations

import os
import subprocess
import sys

FIRST_CALLS = """
import sys
import acshim
import torch
x = torch.linspace(0.01, 120.0, 3872).view(1, 121, 32)
first = getattr(torch, sys.argv[1])(x)
print(torch.equal(first, getattr(torch, sys.argv[1])(x)))
"""


def test_the_first_vector_math_call_after_import_acshim_computes_what_every_later_call_does() -> None:
    # Two intra-op threads (torch's default on two cores; the suite's own OMP_NUM_THREADS=1 dropped).
    env = {key: value for key, value in os.environ.items() if key not in ("OMP_NUM_THREADS", "MKL_CBWR")}
    env["OMP_NUM_THREADS"] = "2"
    # Without the fix, 1 to 5 in 16 such processes raced there: 12 catch it more often than not.
    functions = ["exp", "cos"] * 6
    outcomes = [subprocess.run([sys.executable, "-c", FIRST_CALLS, name], env=env, capture_output=True,
                               text=True, timeout=120) for name in functions]
    for name, done in zip(functions, outcomes):
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.split() == ["True"], (name, done.stdout, done.stderr[-2000:])

