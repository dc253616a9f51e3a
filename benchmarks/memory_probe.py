"""Peak-RSS probe for one training step in a fresh subprocess (method of docs/measuring.md).

The parent calls ``probe(module_path, builder_name, argv)``; the child imports the file, calls
``builder(argv)`` to get ``(model, forward)`` where ``forward() -> loss`` runs one forward, runs one warm-up
step, trims the heap, resets the high-water mark, runs forward (records "held" =
RSS after forward minus baseline) and backward (records "peak" = VmHWM minus baseline), and prints
one JSON line. ``MALLOC_MMAP_THRESHOLD_=65536`` makes every allocation over 64 KiB its own mapping
so freed tensors leave RSS at once.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import subprocess
import sys
from typing import Any

MiB = 2**20


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def hwm_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmHWM missing from /proc/self/status")


def reset_high_water_mark() -> None:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def run_child(path: str, builder: str, argv: list[str]) -> dict[str, Any]:
    spec = importlib.util.spec_from_file_location("_probe_target", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model, forward = getattr(module, builder)(argv)  # forward(): run the model, return the loss
    forward().backward()  # warm-up: lazy initialisation, thread pools
    model.zero_grad(set_to_none=True)  # gradients are not part of what forward holds
    reset_high_water_mark()
    baseline = rss_bytes()
    loss = forward()
    held = rss_bytes() - baseline
    loss.backward()
    peak = hwm_bytes() - baseline
    return {"held_bytes": held, "peak_bytes": peak}


def probe(path: str, builder: str, argv: list[str]) -> dict[str, Any]:
    """Run ``builder(argv)`` from the file ``path`` in a fresh interpreter and return its figures."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    code = (f"import json, sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
            "import memory_probe; "
            f"print('PROBE', json.dumps(memory_probe.run_child({path!r}, {builder!r}, {argv!r})))")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    for line in result.stdout.splitlines():
        if line.startswith("PROBE "):
            return json.loads(line[6:])
    raise RuntimeError(f"memory probe failed:\n{result.stdout}\n{result.stderr}")
