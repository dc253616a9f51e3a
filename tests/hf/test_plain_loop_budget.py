"""A plain Hugging Face training loop under ``acshim run --budget`` (issue 26 item 1): the 12-line
loop of ``scripts/plain_loop.py`` (a 6x128 Llama, vocabulary 512, ``gradient_checkpointing_enable()``,
AdamW, 4 steps), unchanged and with no allocator variable set, plans at 0.5 and 0.3, trains to the
plain run's weights bitwise, keeps the planned steps within the budget by the resident high-water
mark, and prints a whole-step prediction that does not miss the measured peak low (subprocesses: the
patches and the allocator setting are process-wide)."""

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
    env = {key: value for key, value in os.environ.items() if not key.startswith("MALLOC_")}
    env.update(OMP_NUM_THREADS="1", PLAIN_LOOP_FROM_STEP="2")
    weights = directory / f"weights-{budget}.pt"
    command = [sys.executable, *(["-m", "acshim", "run", "--budget", budget] if budget else []), str(SCRIPT),
               str(weights)]
    done = subprocess.run(command, cwd=directory, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    line = [line for line in done.stdout.splitlines() if line.startswith("RSS ")][-1]
    return {**json.loads(line[4:]), "stderr": done.stderr, "weights": weights}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the resident set is read from /proc")
def test_plain_hf_loop_plans_at_half_and_0_3_bitwise_within_budget(tmp_path: Path) -> None:
    import torch

    plain = _run(tmp_path, None)
    reference = torch.load(plain["weights"])
    for budget in ("0.5", "0.3"):
        planned = _run(tmp_path, budget)
        got = torch.load(planned["weights"])
        assert set(got) == set(reference) and all(torch.equal(got[k], reference[k]) for k in got), budget
        assert planned["budget"] is not None and planned["peak"] <= planned["budget"], (budget, planned["peak"])
        assert planned["peak"] < plain["peak"], (budget, planned["peak"], plain["peak"])
        found = SUMMARY.search(planned["stderr"])
        assert found, planned["stderr"][-3000:]
        predicted, measured = float(found.group(1)), float(found.group(2))
        # The whole step's prediction (activations and what the process held besides) never misses
        # the measured peak low by more than 10%. At 0.5 it is within 10% either way; at 0.3 every
        # block goes to disk and the prediction is high (the room left for what the process held
        # besides is not all alive at that plan's peak, at the end of forward): see issue 26.
        assert predicted >= 0.9 * measured, (budget, predicted, measured)
        if budget == "0.5":
            assert abs(predicted - measured) <= max(0.1 * measured, 2.0), (budget, predicted, measured)
            # AdamW's state (10.1 MiB, made by the first step) does not fit the room the first plan
            # left: the second step's start solves it again with the state held (training_state)
            assert "this step started holding 10.1 MiB of optimizer state" in planned["stderr"], planned["stderr"]
