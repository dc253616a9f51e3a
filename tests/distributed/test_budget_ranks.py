"""``acshim run --budget`` and ``acshim plan`` on real gloo ranks (torchrun, 2 processes): every rank
plans on its first step with the others (each measured number agreed as the largest any rank saw),
so DDP ranks run one plan and train bitwise as without checkpointing; sharded models (FSDP2, ZeRO-3)
are planned on their own steps in lock-step (acshim/planner/lockstep.py)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

SCRIPT = str(Path(__file__).resolve().parent / "scripts" / "ddp_budget.py")
PLANNABLE = {"DDP_BUDGET_SIZE": "256x2048"}
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


SHARDED = str(Path(__file__).resolve().parent / "scripts" / "sharded_budget.py")
SHARDED_ROWS = ("--rows", "2048,2048,2048,2048,2048,2048,2048")


@pytest.fixture(scope="module")
def fsdp2_planned(launch, torchrun, tmp_path_factory) -> tuple[list[str], str, Any]:
    """FSDP2 at ``--budget 0.6`` over 7 steps, saving rank 0's plan with ``--plan-file``: one launch
    for test_sharded_ranks_plan_on_their_own_steps_within_budget_and_train_exactly[fsdp2] (the run)
    and test_sharded_plan_file_is_reused_on_every_rank_without_exploring (its first run, the file);
    the command, the plan file's path and the launch."""
    path = str(tmp_path_factory.mktemp("fsdp2-plan") / "plan.json")
    command = torchrun("-m", "acshim", "run", "--budget", "0.6", "--plan-file", path, SHARDED, "--engine", "fsdp2",
                       *SHARDED_ROWS)
    return command, path, launch(command, timeout=400)


@pytest.mark.parametrize("engine", ["fsdp2", "zero3"])
def test_sharded_ranks_plan_on_their_own_steps_within_budget_and_train_exactly(launch, torchrun, request,
                                                                               engine: str) -> None:
    """FSDP2 (fully_shard per block and root) and a DeepSpeed engine at ZeRO-3: two steps run every
    region recomputed with its input on disk, then one recomputed, one offloaded (disk), and one with
    a block selective and one selective-alt where each is predicted within the budget, all measured;
    rank 0 solves and broadcasts, the next step verifies. Every
    step of every rank peaks within the budget as the kernel's VmHWM sees it, the plan keeps or
    offloads some blocks, and the full weights after 7 steps (dropout on) equal the same engine's without
    checkpointing bitwise. (FSDP2's run also saves its plan, for the plan-file test: ``fsdp2_planned``.)"""
    if engine == "fsdp2":
        result = request.getfixturevalue("fsdp2_planned")[2]
    else:
        command = torchrun("-m", "acshim", "run", "--budget", "0.6", SHARDED, "--engine", engine, *SHARDED_ROWS)
        # two explored steps more than before (the storage choices'): ZeRO-3's 12 steps took over 240 s at load 13
        result = launch(command, timeout=400)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = result.results
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["equal"] and r["finite"] for r in ranks), ranks
    assert ranks[0]["choices"] == ranks[1]["choices"], ranks   # rank 0's plan, broadcast
    assert set(ranks[0]["choices"]) != {"recompute"}, ranks         # some region kept or offloaded
    for r in ranks:
        assert max(r["peaks"]) <= r["budget"], r                  # explored, verified and planned steps alike
        assert max(r["peaks"]) < 0.8 * max(r["none"]), r          # and memory was saved, as measured
        # four explored steps, and the sampled one where a selective block fits the budget (then offered)
        assert r["explored"] == 4 + bool({"selective", "selective-alt"} & set(r["offered"])), r
        assert len(r["measured"]) == r["explored"] + 1, r            # one verification
    replaced = re.findall(r"acshim: --budget [\d.]+ MiB: replaced 4 region\(s\)", result.stderr)
    assert len(replaced) == 1, result.stderr[-3000:]
    assert re.search(r"the plan's step peaked at [\d.]+ MiB \(0\.\d\d of the budget, within it\)", result.stderr)


def test_sharded_step_with_larger_inputs_is_explored_again_within_the_budget(launch, torchrun) -> None:
    """Dynamic shapes on FSDP2: a step larger than any planned for (on any rank) runs recomputed and
    is measured, and the next step gets a plan for it, within the same bytes (2048 rows). Where no
    plan fits the larger inputs (4096 rows: the least plan needs about 83 MiB), the run is not ended
    (it was: exit 2 on every rank): the refusal is said with the budget it names and the steps go
    on under the least-memory plan, bitwise as FSDP2 without checkpointing."""
    command = torchrun("-m", "acshim", "run", "--budget", "60MiB", SHARDED, "--engine", "fsdp2",
                       "--rows", "1024,1024,1024,1024,1024,2048,2048,2048,2048,2048,2048,4096,4096,4096")
    result = launch(command, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = result.results
    assert all(r["equal"] and r["finite"] for r in ranks), ranks
    assert "larger than those planned for: this step runs every region recompute+offload:disk" in result.stderr
    assert "no plan fits the larger inputs explored" in result.stderr and "pass --budget" in result.stderr
    assert "the run goes on under the least-memory plan" in result.stderr, result.stderr[-3000:]
    for r in ranks:
        assert r["budget"] == 60 << 20
        assert max(r["peaks"][:11]) <= r["budget"], r                 # every step up to 2048 rows
        assert max(r["peaks"][11:]) < min(r["none"][11:]), r          # 4096 rows: less than without checkpointing


def test_sharded_plan_file_is_reused_on_every_rank_without_exploring(launch, fsdp2_planned) -> None:
    """``--plan-file``: the first run saves the plan rank 0 made (7 steps: the run the FSDP2 test
    above checks, launched once for both); the second runs it from its first step on every rank
    (nothing explored), as exact and within the budget."""
    command, path, first = fsdp2_planned
    assert first.returncode == 0, first.stderr[-3000:]
    again = launch(command, timeout=400)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"reused from {path} (not profiled again)" in again.stderr
    assert [r["choices"] for r in again.results] == [first.results[0]["choices"]] * 2
    for r in again.results:
        assert r["equal"] and r["finite"] and max(r["peaks"]) <= r["budget"], r
        assert r["measured"] == [], r  # no step explored or verified


def test_sharded_budget_below_full_recompute_is_refused_naming_one_that_plans(launch, torchrun) -> None:
    """A budget below what the least plan needs (every region recomputed or offloaded) ends every
    rank with exit 2 after the explored steps, naming a budget; that budget then plans."""
    # refused before its results: the run without checkpointing is not made (--planned-only)
    command = torchrun("-m", "acshim", "run", "--budget", "20MiB", SHARDED, "--engine", "fsdp2",
                       "--rows", "2048,2048,2048,2048,2048,2048", "--planned-only")
    result = launch(command, timeout=240)
    assert result.returncode != 0
    # (no selective-op sampled, nor every region offloaded: predicted over 20 MiB, those steps are skipped)
    found = re.search(r"the least any plan of keep, recompute, "
                      r"recompute\+offload:disk needs: [\d.]+ MiB "
                      r"above the step.s start .*; pass --budget ([\d.]+MiB) or more", result.stderr)
    assert found, result.stderr[-3000:]
    assert "RESULT" not in result.stdout
    again = launch(torchrun("-m", "acshim", "run", "--budget", found.group(1), SHARDED, "--engine", "fsdp2",
                            "--rows", "2048,2048,2048,2048,2048,2048"),
                   timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    assert all(r["equal"] and r["finite"] and max(r["peaks"]) <= r["budget"] for r in again.results), again.results


def test_acshim_plan_across_sharded_ranks_prints_one_table_or_says_the_script_was_too_short(launch, torchrun) -> None:
    """``acshim plan`` on a sharded model: the plan is made when the sixth step starts, printed once,
    and every rank exits 0 there; a script that ends before that is an error naming the steps needed."""
    env: dict[str, str] = {}
    # both end before the script's results: the run without checkpointing is not made (--planned-only)
    result = launch(torchrun("-m", "acshim", "plan", "--budget", "0.6", "--", SHARDED, "--engine", "fsdp2",
                             "--rows", "2048,2048,2048,2048,2048,2048", "--planned-only"), env=env, timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("acshim plan: budget") == 1
    assert "measured on the script's own steps, in lock-step" in result.stdout
    assert "RESULT" not in result.stdout
    short = launch(torchrun("-m", "acshim", "plan", "--budget", "0.6", "--", SHARDED, "--engine", "fsdp2",
                            "--rows", "2048,2048,2048", "--planned-only"), env=env, timeout=240)
    assert short.returncode != 0
    assert "the script ended before its sharded model's plan was made: it is planned on the script's own steps " \
           "and needs up to 6 training steps" in short.stderr, short.stderr[-3000:]


def test_refused_budget_is_named_in_torchruns_failure_summary(launch, torchrun) -> None:
    """A budget no plan can meet ends every rank with exit 2 and acshim's message; the rank writes
    torchrun's error file, so the launcher's failure summary names the cause (not ``<N/A>``)."""
    result = launch(torchrun("-m", "acshim", "run", "--budget", "1KiB", SCRIPT, "--setting", "plain"))
    assert result.returncode != 0
    root_cause = result.stderr[result.stderr.index("Root Cause"):]
    assert "exitcode  : 2" in root_cause and "error_file: <N/A>" not in root_cause, root_cause
    assert re.search(r"traceback : acshim run: --budget 1KiB: .*; pass --budget [\d.]+MiB or more", root_cause), root_cause
    assert "RESULT" not in result.stdout
