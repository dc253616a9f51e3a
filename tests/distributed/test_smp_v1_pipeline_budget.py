"""``acshim run --budget`` on an SMP v1 pipeline (``pipeline_parallel_degree`` 2, automatic
partitioning, 2 microbatches, gloo, 2 ranks; scripts/smp_v1_pipeline_budget.py): each stage plans
alone the regions it owns, as they run on it (the driver's forward with its calls to the other
stage replayed, the serving stage's calls of a whole microbatch run again), for the one microbatch
acshim's runner keeps alive at once (counted on the serving stage), within what is left of the
rank's budget once the messages' copies are paid; weights and losses stay bitwise those of the
same run unplanned (dropout on), and each rank's ``VmHWM`` above its first step's start stays
within its budget (acshim/planner/pipelines.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

SCRIPT = str(Path(__file__).resolve().parent / "scripts" / "smp_v1_pipeline_budget.py")
ENV: dict[str, str] = {}  # no allocator variable: acshim run owns the allocator (acshim.allocator)
RANK_LINE = (r"acshim: --budget ([\d.]+) MiB on rank (\d), pipeline stage (\d) of 2: predicted peak ([\d.]+) MiB "
             r"\(([\d.]+) MiB schedule \+ 1 x [\d.]+ MiB activations \+ [\d.]+ MiB held besides\), measured "
             r"([\d.]+) MiB \(VmHWM above the first step's start\)")


def _check(run, pipeline: str) -> None:
    """Both stages planned, exact, within budget by ``VmHWM`` (the script's and acshim's figures)."""
    assert run.returncode == 0, run.stderr[-4000:]
    ranks = run.results
    assert [(r["rank"], r["stage"]) for r in ranks] == [(0, 0), (1, 1)]
    assert all(r["equal"] for r in ranks), ranks                   # losses and own weights, 2 steps
    assert [r["in_flight"] for r in ranks] == [1, 1]
    assert ranks[1]["most_alive"] == 1                              # measured: one microbatch's calls at once
    assert "head.weight" in ranks[1]["parameters"] and "embed.weight" in ranks[0]["parameters"]
    assert all(set(r["choices"]) != {"keep"} and len(r["choices"]) == 8 for r in ranks), ranks
    figures = [(r["rank"], round(r["peak"] / 2**20, 1), round(r["budget"] / 2**20, 1)) for r in ranks]
    assert all(r["peak"] <= r["budget"] for r in ranks), f"(rank, VmHWM MiB, budget MiB): {figures}"
    planned = re.findall(rf"on rank (\d), SageMaker model parallelism v1 stage (\d) of 2, {pipeline} schedule, 2 "
                         r"microbatches: up to 1 alive at once: the schedule holds [\d.]+ MiB \(.*?\): planned for "
                         r"one microbatch within [\d.]+ MiB .*?: replaced 8 region\(s\)", run.stderr)
    assert sorted(planned) == [("0", "0"), ("1", "1")], run.stderr[-3000:]
    lines = re.findall(RANK_LINE, run.stderr)
    assert sorted((line[1], line[2]) for line in lines) == [("0", "0"), ("1", "1")], run.stderr[-3000:]
    for budget, _, _, predicted, held, measured in lines:
        assert 0 < float(held) and float(measured) <= float(predicted) <= float(budget), lines


@pytest.mark.parametrize("pipeline", ["interleaved", "simple"])
def test_each_smp_v1_stage_plans_its_own_regions_within_a_fractional_budget_and_trains_exactly(
        launch, torchrun, pipeline: str) -> None:
    run = launch(torchrun("-m", "acshim", "run", "--budget", "0.6", SCRIPT, "--pipeline", pipeline), env=ENV,
                 timeout=300)
    _check(run, pipeline)


def test_an_smp_v1_budget_in_mib_plans_both_stages_and_one_too_small_is_refused_naming_one(
        launch, torchrun) -> None:
    """A budget below what a stage needs ends the run with exit 2 on the refusing rank, naming what
    its schedule holds and a budget that plans; that budget then plans every rank within it."""
    small = launch(torchrun("-m", "acshim", "run", "--budget", "30MiB", SCRIPT, "--planned-only"), env=ENV,
                   timeout=300)
    assert small.returncode != 0 and "RESULT" not in small.stdout
    assert re.search(r"exitcode\s*: 2", small.stderr), small.stderr[-3000:]
    assert not re.search(r"exitcode\s*: 1", small.stderr), small.stderr[-3000:]   # the other stage exits 2 too
    found = re.findall(r"acshim run: --budget 30MiB: SageMaker model parallelism v1 stage (\d) of 2, interleaved "
                       r"schedule, 2 microbatches: up to 1 alive at once: the schedule holds ([\d.]+) MiB besides; "
                       r"one microbatch: .*?; pass --budget ([\d.]+)MiB or more", small.stderr)
    assert found, small.stderr[-3000:]
    suggested = max(float(value) for _, _, value in found)
    assert all(float(value) > float(held) for _, held, value in found), found
    fits = launch(torchrun("-m", "acshim", "run", "--budget", f"{max(suggested, 90.0)}MiB", SCRIPT), env=ENV,
                  timeout=300)
    _check(fits, "interleaved")


def test_acshim_plan_on_smp_v1_stages_is_refused_saying_when_each_stage_plans(launch, torchrun) -> None:
    """``acshim plan`` would end one stage while the other waits: refused with exit 2, saying that
    each SMP v1 stage plans at its second microbatch (the first shows the calls' shapes). Refused
    before the script's results: its unplanned run is not made (``--planned-only``)."""
    run = launch(torchrun("-m", "acshim", "plan", "--budget", "0.6", "--", SCRIPT, "--planned-only"), env=ENV,
                 timeout=300)
    assert run.returncode != 0 and "RESULT" not in run.stdout
    assert re.search(r"exitcode\s*: 2", run.stderr), run.stderr[-3000:]
    assert not re.search(r"exitcode\s*: 1", run.stderr), run.stderr[-3000:]       # whichever rank torchrun sees first
    assert "each stage plans at its own second microbatch" in run.stderr, run.stderr[-3000:]
