"""A plain Hugging Face training loop under ``acshim run --budget`` (issue 26 item 1): the 12-line
loop of ``scripts/plain_loop.py`` (a 6x128 Llama, vocabulary 512, ``gradient_checkpointing_enable()``,
AdamW, 4 steps), unchanged and run as a user runs it (no allocator or thread variable), measured over
the whole run from its first step's start (planning, the code it pages in and AdamW's state
counted). At 0.5 it plans, trains to the plain run's weights bitwise, and stays within the budget
(3%: the planned steps hold 3-4 MiB more than their verification, not yet traced) with the
optimizer's state foreseen; at 0.3 it is refused naming a budget, at which it plans and stays within
it (subprocesses: the patches and the allocator setting are process-wide)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parent / "scripts" / "plain_loop.py"
SUMMARY = re.compile(r"replaced 6 region\(s\).*predicted peak ([\d.]+) MiB.*?, measured ([\d.]+) MiB")


def _run(directory: Path, budget: str | None) -> dict:
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("MALLOC_") and key not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env.update(PLAIN_LOOP_FROM_STEP="1")
    weights = directory / f"weights-{budget}.pt"
    command = [sys.executable, *(["-m", "acshim", "run", "--budget", budget] if budget else []), str(SCRIPT),
               str(weights)]
    done = subprocess.run(command, cwd=directory, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode == 2:
        named = re.search(r"pass --budget (\S+) or more", done.stderr)
        assert named, done.stderr[-4000:]
        return {"named": named.group(1), "stderr": done.stderr}
    assert done.returncode == 0, done.stderr[-4000:]
    line = [line for line in done.stdout.splitlines() if line.startswith("RSS ")][-1]
    return {**json.loads(line[4:]), "stderr": done.stderr, "weights": weights}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the resident set is read from /proc")
def test_plain_hf_loop_keeps_half_and_the_budget_0_3_names_for_the_whole_run_bitwise(tmp_path: Path) -> None:
    import torch

    plain = _run(tmp_path, None)
    reference = torch.load(plain["weights"])
    for budget in ("0.5", "0.3"):
        planned = _run(tmp_path, budget)
        if "named" in planned:  # below what the loop holds whatever the plan (docs/planner.md's table)
            assert budget == "0.3", planned["stderr"][-3000:]
            assert "10.1 MiB of optimizer state its first step() will make" in planned["stderr"], \
                planned["stderr"][-3000:]
            planned = _run(tmp_path, planned["named"])
        got = torch.load(planned["weights"])
        assert set(got) == set(reference) and all(torch.equal(got[k], reference[k]) for k in got), \
            (budget, planned["stderr"][-3000:])
        assert planned["budget"] is not None and planned["peak"] <= planned["budget"] * 1.03, \
            (budget, planned["peak"] / planned["budget"], planned["stderr"][-2000:])
        assert planned["peak"] < plain["peak"], (budget, planned["peak"], plain["peak"])
        found = SUMMARY.search(planned["stderr"])
        assert found, planned["stderr"][-3000:]
        predicted, measured = float(found.group(1)), float(found.group(2))
        # The whole step's prediction (activations, what the process held besides and what is
        # charged) never misses the measured peak low by more than 10%; at 0.5, within 10% either way.
        assert predicted >= 0.9 * measured, (budget, predicted, measured)
        if budget == "0.5":
            assert abs(predicted - measured) <= max(0.1 * measured, 2.0), (budget, predicted, measured)
            # AdamW's state (10.1 MiB) is charged to the first plan before its first step makes it
            assert "10.1 MiB of optimizer state its first step() will make" in planned["stderr"], \
                planned["stderr"][-3000:]
