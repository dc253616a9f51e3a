"""``acshim run --budget`` and ``acshim plan`` on real gloo ranks (torchrun, 2 processes): every rank
plans on its first step with the others (each measured number agreed as the largest any rank saw),
so DDP ranks run one plan and train bitwise as without checkpointing; sharded models are refused."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

SCRIPT = str(Path(__file__).resolve().parent / "scripts" / "ddp_budget.py")
PLANNABLE = {"DDP_BUDGET_SIZE": "256x2048", "MALLOC_MMAP_THRESHOLD_": "65536"}
"""Activations the process's memory resolves (about 80 MB without checkpointing), measured as
docs/measuring.md says."""


@pytest.mark.parametrize(("setting", "reentrant", "slow_rank"), [
    ("plain", False, None),
    ("static_graph", True, None),        # DDP records used parameters on the first step: planning must not touch it
    ("find_unused", False, "1"),         # rank 1 is slower: its timings differ, its plan must not
], ids=["plain", "static_graph-reentrant", "find_unused-slow_rank"])
def test_ddp_ranks_share_one_plan_within_budget_and_train_exactly(launch, torchrun, setting: str, reentrant: bool,
                                                                  slow_rank: str | None) -> None:
    env = {**PLANNABLE, **({"SLOW_RANK": slow_rank} if slow_rank else {})}
    command = torchrun("-m", "acshim", "run", "--budget", "0.6", SCRIPT, "--setting", setting,
                       *(["--reentrant"] if reentrant else []))
    result = launch(command, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = result.results
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["equal"] for r in ranks), ranks               # weights after 3 steps, dropout on
    assert ranks[0]["choices"] == ranks[1]["choices"], ranks   # one plan
    assert ranks[0]["budget"] == ranks[1]["budget"]
    assert all(r["peak"] <= r["budget"] for r in ranks), ranks  # each rank's step measured within it
    replaced = re.findall(r"acshim: --budget [\d.]+ MiB: replaced 4 region\(s\)", result.stderr)
    assert len(replaced) == 1, result.stderr[-3000:]           # one log line for the job


def test_plan_across_ranks_prints_one_table_and_exits(launch, torchrun) -> None:
    result = launch(torchrun("-m", "acshim", "plan", "--budget", "0.6", "--", SCRIPT), env=PLANNABLE)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("acshim plan: budget") == 1
    assert "agreed across 2 ranks" in result.stdout
    assert "RESULT" not in result.stdout  # exited inside the first step, before training on


def test_fsdp2_across_ranks_is_refused_naming_the_fix(launch, torchrun) -> None:
    result = launch(torchrun("-m", "acshim", "run", "--budget", "0.6", SCRIPT, "--setting", "fsdp2"))
    assert result.returncode != 0
    assert "planning across 2 ranks supports replicated models (DistributedDataParallel, or none); this one is " \
           "sharded by fully_shard (FSDP2)" in result.stderr
    assert "RESULT" not in result.stdout


def test_refused_budget_is_named_in_torchruns_failure_summary(launch, torchrun) -> None:
    """A budget no plan can meet ends every rank with exit 2 and acshim's message; the rank writes
    torchrun's error file, so the launcher's failure summary names the cause (not ``<N/A>``)."""
    result = launch(torchrun("-m", "acshim", "run", "--budget", "1KiB", SCRIPT, "--setting", "plain"))
    assert result.returncode != 0
    root_cause = result.stderr[result.stderr.index("Root Cause"):]
    assert "exitcode  : 2" in root_cause and "error_file: <N/A>" not in root_cause, root_cause
    assert re.search(r"traceback : acshim run: --budget 1KiB: .*; pass --budget [\d.]+MiB or more", root_cause), root_cause
    assert "RESULT" not in result.stdout
