"""A refusal of ``acshim.plan`` names a budget that plans (issue 26 items 1 and 2), tested by planning
at it, and for the process's memory points to ``memory="tensors"``: docs/planner.md's planner call on
``acshim.testing.GPT()`` at 0.5. Fresh process: the allocator setting and the resident set are
process-wide."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, re
import acshim, torch
from acshim.testing import GPT
torch.manual_seed(0)
model, ids = GPT(), torch.randint(0, 512, (8, 64))
out = {}
try:
    out["planned"] = acshim.plan(model, ids, 0.5).budget
except acshim.planner.BudgetTooSmall as error:
    out["refused"] = str(error)
    named = int(re.search(r"pass budget=(\\d+) ", str(error)).group(1))
    out["named"], out["planned_at_named"] = named, acshim.plan(model, ids, named).budget
out["tensors"] = acshim.plan(model, ids, 0.5, memory="tensors").budget
print("RESULT " + json.dumps(out))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the process's memory is read from /proc")
def test_readme_plan_call_plans_or_names_a_budget_that_does(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith("MALLOC_")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads([line for line in done.stdout.splitlines() if line.startswith("RESULT ")][-1][7:])
    if "refused" in out:
        assert 'memory="tensors"' in out["refused"], out
        assert out["planned_at_named"] == out["named"], out
    else:
        assert out["planned"] > 0, out
    assert out["tensors"] > 0, out
