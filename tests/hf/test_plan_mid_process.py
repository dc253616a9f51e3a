"""``acshim.plan`` in a process that trained before it, as a user's has: glibc's mmap threshold had
risen over those steps (it follows the largest block freed), so their activations came from the
heap, and the heap keeps its free chunks resident once they are reused. Planning there was refused
(HF Llama 6x384, batch 2x256, at 0.5: "no plan measured within the budget 51.9 MiB after 7
re-solves", every plan over its prediction); planned on acshim's CPU allocator but trained on the
heap, the steps held 85 MiB of a 55 MiB budget. Now the call plans on acshim's allocator and leaves
it installed, so the plan's steps keep the budget (a fresh process: the heap's state matters)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parent / "scripts" / "plan_mid_process.py"


def test_plan_after_unplanned_steps_plans_and_its_steps_keep_the_budget() -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith("MALLOC_")}
    done = subprocess.run([sys.executable, str(SCRIPT), "6", "384", "256", "0.5"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith("PLANNED "), line
    found = json.loads(line[len("PLANNED "):])
    assert found["installed"], found                                      # the plan's steps run on it
    assert abs(found["predicted"] - found["measured"]) <= max(0.1 * found["measured"], 2 * 2**20), found
    assert all(0 < peak <= found["budget"] for peak in found["peaks"]), found
