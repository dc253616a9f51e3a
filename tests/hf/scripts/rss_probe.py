"""Run a Trainer script (``sys.argv[1:]``) and print its peak RSS above the baseline of its first
training step: ``RSS {"peak": bytes, "budget": bytes or null}`` (shared/MEASURING.md: run with
``MALLOC_MMAP_THRESHOLD_=65536``; the heap is trimmed and the high-water mark reset when the first
``Trainer.training_step`` starts, after the model and its parameters exist, so planning counts)."""

import atexit
import ctypes
import json
import os
import runpy
import sys

import transformers

state = {"baseline": None, "steps": 0}
FROM_STEP = int(os.environ.get("RSS_PROBE_FROM_STEP", "1"))
"""The training step (1-based) whose start is the baseline: 1 counts planning, 2 the planned steps only."""


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


original = transformers.Trainer.training_step


def training_step(self, *args, **kwargs):
    state["steps"] += 1
    if state["steps"] == FROM_STEP:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        state["baseline"] = _rss()
    return original(self, *args, **kwargs)


transformers.Trainer.training_step = training_step


@atexit.register
def report() -> None:
    import acshim.region

    routers = acshim.region.ROUTERS
    plan = routers[0].plan if routers else None
    print("RSS " + json.dumps({"peak": _hwm() - (state["baseline"] or 0), "budget": plan.budget if plan else None,
                               "outside": plan.outside if plan else None}), flush=True)


sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
