"""Run a Trainer script (``sys.argv[1:]``) as its user would, and print at exit one line
``PROBE {"peak": bytes, "budget": bytes or null, "plan": str or null, "starts": [seconds, ...]}``:
the resident high-water mark (``VmHWM``) above what the process held when the first
``Trainer.training_step`` started (the heap trimmed and the mark reset there: planning counts), the
budget and plan ``acshim run --budget`` made, if any, and when each training step started
(``time.perf_counter``), so that the time between two starts is one whole step, optimizer included (the last step's
end is not taken: the script's own end-of-training work follows it).
For benchmarks/bench_trl.py; shared/MEASURING.md for the method."""

from __future__ import annotations

import atexit
import json
import os
import runpy
import sys
import time
from typing import Any

import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from memory_probe import hwm_bytes, reset_high_water_mark, rss_bytes  # benchmarks/ is not a package

state: dict[str, Any] = {"baseline": None, "starts": []}


original = transformers.Trainer.training_step


def training_step(self: Any, *args: Any, **kwargs: Any) -> Any:
    if state["baseline"] is None:
        reset_high_water_mark()
        state["baseline"] = rss_bytes()
    state["starts"].append(time.perf_counter())
    return original(self, *args, **kwargs)


transformers.Trainer.training_step = training_step


@atexit.register
def report() -> None:
    plan = None
    if "acshim.region" in sys.modules:
        routers = sys.modules["acshim.region"].ROUTERS
        plan = routers[0].plan if routers else None
    print("PROBE " + json.dumps({"peak": hwm_bytes() - (state["baseline"] or 0),
                                 "budget": plan.budget if plan else None,
                                 "plan": plan.describe() if plan else None,
                                 "starts": state["starts"]}), flush=True)


sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
