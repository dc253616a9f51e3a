"""A memory budget is a promise about the process's memory (issue 17, issue 18 items 2 and 3): under
``acshim run --budget`` the resident high-water mark above a baseline taken with parameters and
gradients allocated stays within the budget on every step, the planning step included, measured as
docs/measuring.md says (fresh process, ``MALLOC_MMAP_THRESHOLD_=65536``, ``VmHWM`` reset each step
through ``/proc/self/clear_refs``). Subprocesses: the patches, the router and the high-water mark
are process-wide."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")

PROBE = """
import ctypes, json, os, sys, time, torch
torch.set_num_threads(1)

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

def hwm():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

def reset():
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")

def budget():
    import acshim.region
    routers = acshim.region.ROUTERS
    return routers[0].plan.budget if routers and routers[0].plan is not None else None
"""

HF_LOOP = PROBE + """
import transformers
layers, width, batch = (int(n) for n in sys.argv[1].split("x"))
config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=width // 64, n_positions=256, vocab_size=512,
                                 bos_token_id=0, eos_token_id=1)
torch.manual_seed(0)
model = transformers.GPT2LMHeadModel(config)
model.train()
lengths = [int(n) for n in sys.argv[2].split(",")]
batches = [torch.randint(0, 512, (batch, n), generator=torch.Generator().manual_seed(i)) for i, n in enumerate(lengths)]
model(input_ids=batches[-1], labels=batches[-1]).loss.backward()  # lazy initialisation (one step, no regions)
model.zero_grad(set_to_none=False)                                # gradients stay allocated
model.gradient_checkpointing_enable()
reset()
base = rss()
peaks = []
for ids in batches:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    del loss
    with torch.no_grad():                                         # evaluation: no backward, no plan
        model(input_ids=ids)
    peaks.append(hwm() - base)
    reset()
print("RESULT " + json.dumps({"peaks": peaks, "budget": budget()}))
"""


def _run(tmp_path: Path, script: str, *args: str, budget: str, extra: tuple[str, ...] = ()
         ) -> subprocess.CompletedProcess:
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(script))
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "acshim", "run", "--budget", budget, *extra, str(path), *args],
                          cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env)


def _result(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, done.stderr[-4000:]
    line = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("budget", ["0.3", "0.5"])
def test_whole_run_high_water_mark_within_budget_planning_step_included(tmp_path: Path, budget: str) -> None:
    """Issue 17's scenario: a plain Hugging Face loop (GPT-2 8x384, batch 2x256,
    gradient_checkpointing_enable, 4 steps): the resident high-water mark of every step above the
    baseline (parameters and gradients allocated) is within the budget, the step the plan is made in
    first. (Before this change: 150 MB above the baseline at a budget of 83.6 MiB, 1.7x, the planning
    step the peak.)"""
    result = _result(_run(tmp_path, HF_LOOP, "8x384x2", "256,256,256,256", budget=budget))
    limit = result["budget"] * 1.02
    assert all(peak <= limit for peak in result["peaks"]), (result, [p / limit for p in result["peaks"]])


def test_dynamic_padding_every_step_within_budget_and_no_warning_for_evaluation(tmp_path: Path) -> None:
    """Issue 18 item 3: five steps of growing sequence length (dynamic padding): each step larger
    than any planned for is planned again before it runs, within the budget's bytes (the first
    plan's); every step's high-water mark stays within them; the evaluation forwards (no backward)
    between steps are neither planned nor warned about."""
    done = _run(tmp_path, HF_LOOP, "4x256x4", "96,112,128,144,160", budget="0.9")  # bytes: the first step's plan
    result = _result(done)
    limit = result["budget"] * 1.02
    assert all(peak <= limit for peak in result["peaks"]), (result, [p / limit for p in result["peaks"]])
    assert len(re.findall(r"are larger than those planned for .*: planned again", done.stderr)) == 4, done.stderr
    assert "may exceed" not in done.stderr and "inputs hold" not in done.stderr
