"""Issue 26 items 1 and 2: a budget at or above the least one the planner reports plans, and a
refusal names a budget that plans. Tested by planning at the number the planner gave, in a fresh
process, and measuring every step's resident high-water mark (``VmHWM``) above a baseline taken with
parameters and gradients allocated (docs/measuring.md); and README's train.py as a user runs it:
its whole run within ``--budget 0.7``, and at ``0.5`` refused naming a budget it keeps."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

MEMORY_FUNCTIONS = (Path(__file__).parent / "vmhwm_functions.py").read_text()
"""rss(), hwm() and reset(), pasted into the probe scripts."""

pytestmark = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import ctypes, json, os, sys, torch
from torch import nn
""" + MEMORY_FUNCTIONS + """
torch.manual_seed(0)
model = nn.Sequential(*(nn.Sequential(nn.Linear(512, 512), nn.GELU(), nn.Dropout(0.1)) for _ in range(8)))
batch = torch.randn(1024, 512)
model(batch).square().mean().backward()   # lazy initialisation; gradients stay allocated
model.zero_grad(set_to_none=False)
"""

LOOP = PROBE + """
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
for index in range(len(model)):
    model[index] = checkpoint_wrapper(model[index])
reset()
base = rss()
peaks = []
for step in range(3):
    model(batch).sum().backward()  # the loss planning assumes (a loss outside the forward is not planned)
    peaks.append(hwm() - base)
    reset()
import acshim.region
routers = acshim.region.ROUTERS
print("RESULT " + json.dumps({"peaks": peaks, "budget": routers[0].plan.budget if routers else None}))
"""

API = PROBE + """
import acshim
from acshim.planner import BudgetTooSmall
budget = float(sys.argv[1]) if "." in sys.argv[1] else int(sys.argv[1])
acshim.plan(model, batch, 0.9, choices=("keep", "recompute"), memory="tensors")  # code paged in, as acshim run's warm-up
reset()
base = rss()
out = {}
try:
    out["budget"] = acshim.plan(model, batch, budget, choices=("keep", "recompute")).budget
except BudgetTooSmall as error:
    out["refused"], out["suggested"] = str(error), error.suggested
out["peak"] = hwm() - base
print("RESULT " + json.dumps(out))
"""


def _run(tmp_path: Path, script: str, *argv: str, threads: int = 1, environment: bool = True
         ) -> subprocess.CompletedProcess:
    """Run ``script`` (SCRIPT in ``argv``): with ``environment``, under the allocator variable and
    the ``threads`` torch threads of docs/measuring.md; else in the environment a user has."""
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(script))
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("MALLOC_") and key not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["PYTHONPATH"] = str(REPO)
    if environment:
        env.update(MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS=str(threads))
    command = [str(path) if word == "SCRIPT" else word for word in argv]
    return subprocess.run([sys.executable, *command], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env=env)


def _result(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads([line for line in done.stdout.splitlines() if line.startswith("RESULT ")][-1][7:])


def _within(result: dict) -> None:
    limit = result["budget"] * 1.02
    assert result["budget"] and all(peak <= limit for peak in result["peaks"]), \
        (result, [peak / limit for peak in result["peaks"]])


def test_the_least_budget_acshim_plan_prints_plans_within_it(tmp_path: Path) -> None:
    """``acshim plan --sweep`` prints the least budget that plans atop the frontier; ``acshim run``
    at exactly that many bytes plans, and every step stays within them by the resident set."""
    done = _run(tmp_path, LOOP, "-m", "acshim", "plan", "--sweep", "--budget", "0.7", "--", "SCRIPT")
    assert done.returncode == 0, done.stderr[-4000:]
    least = int(re.search(r"least budget that plans: (\d+) bytes", done.stdout).group(1))
    _within(_result(_run(tmp_path, LOOP, "-m", "acshim", "run", "--budget", str(least), "SCRIPT")))


def test_a_refused_run_names_a_budget_that_plans_within_it(tmp_path: Path) -> None:
    """``acshim run --budget`` below what any plan needs exits 2 naming a budget and why; run at that
    budget it plans, and every step stays within it. The budget named is the frontier's least (said
    in the message), also where a block could not be measured within the budget at all: the refusal
    measures it within a larger bound first (before, it named 3 times how far the stopped measurement
    got, 58 MiB here, where 31.5 MiB plans)."""
    done = _run(tmp_path, LOOP, "-m", "acshim", "run", "--budget", "0.4", "SCRIPT")
    assert done.returncode == 2, done.stderr[-4000:]
    named = re.search(r"pass --budget (\S+) or more", done.stderr)
    assert named, done.stderr[-3000:]
    assert "the least peak the planner predicts" in done.stderr, done.stderr[-3000:]
    _within(_result(_run(tmp_path, LOOP, "-m", "acshim", "run", "--budget", named.group(1), "SCRIPT")))


def test_acshim_plan_refusal_names_the_frontiers_least_budget_and_it_plans_within_it(tmp_path: Path) -> None:
    """``acshim.plan`` with keep and recompute alone at 24 MiB (0.46 of no checkpointing's 52 MiB):
    every measurement fits, no plan does;
    ``BudgetTooSmall.suggested`` is the planner's least budget (its least predicted peak and what it
    holds besides), the message says so, and planning at it succeeds within it."""
    refused = _result(_run(tmp_path, API, "SCRIPT", str(24 << 20)))
    assert "least peak the planner predicts" in refused["refused"], refused
    planned = _result(_run(tmp_path, API, "SCRIPT", str(refused["suggested"])))
    assert planned.get("budget") == refused["suggested"], planned
    assert planned["peak"] <= planned["budget"] * 1.02, planned


def _readme_train_script_measured() -> str:
    """README's train.py as written, with the whole run's resident high-water mark printed: the
    baseline is taken once, before the first step (the heap trimmed, the mark reset), and never
    reset after, so planning, the code the steps page in and the script's own loss all count."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    script = re.search(r"```python\n(# train\.py.*?)```", readme, re.S).group(1)
    assert "for step in range(4):" in script, script
    script = script.replace("for step in range(4):", "reset()\nbase = rss()\nfor step in range(4):", 1)
    return MEMORY_FUNCTIONS + script + """
import acshim.region, json
routers = acshim.region.ROUTERS
print("RESULT " + json.dumps({"peaks": [hwm() - base], "budget": routers[0].plan.budget if routers else None}))
"""


def test_readme_train_script_keeps_its_budget_for_the_whole_run_as_users_run_it(tmp_path: Path) -> None:
    """README's train.py as written and run as a user runs it (no ``MALLOC_*`` or thread variable):
    ``acshim run --budget 0.7`` plans and keeps the whole run within the budget by ``VmHWM`` above
    the first step's start, planning included. Before, the code the step paged in (file-backed pages,
    6-15 MiB by the page cache's state) and the script's own loss on the planning step went
    uncharged: 1.15x the budget on the planning step and 1.21x on later ones. ``--budget 0.5`` plans
    or is refused (exit 2) naming a budget; where it plans, or at the budget named, the whole run
    stays within it. ``--budget 0.3`` (below full recompute's whole step here) is refused naming the
    frontier's least budget, which plans: before, the counting forward was stopped at a lower bound
    of the budget and the refusal named no checkpointing's peak from the step on fake tensors (86.4
    MiB); now that forward is counted again, the model profiled, and the frontier's number named.
    The batch the script makes before each forward is held when the planned step starts, so it is
    allowed beside the budget."""
    script = _readme_train_script_measured()
    batch = 2048 * 512 * 4
    for fraction in ("0.7", "0.5", "0.3"):
        budget = fraction
        done = _run(tmp_path, script, "-m", "acshim", "run", "--budget", budget, "SCRIPT", environment=False)
        if done.returncode == 2 and fraction != "0.7":
            named = re.search(r"pass --budget (\S+) or more", done.stderr)
            assert named and "charged besides the measurement" in done.stderr, done.stderr[-3000:]
            assert "the least peak the planner predicts" in done.stderr, done.stderr[-3000:]
            budget = named.group(1)
            done = _run(tmp_path, script, "-m", "acshim", "run", "--budget", budget, "SCRIPT", environment=False)
        result = _result(done)
        assert result["budget"], result
        assert result["peaks"][0] <= result["budget"] * 1.02 + batch, (budget, result,
                                                                       result["peaks"][0] / result["budget"])
