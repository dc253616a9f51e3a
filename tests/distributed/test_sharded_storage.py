"""Sharded models (FSDP2, ZeRO-3) under ``torchrun -m acshim run --budget`` are offered the storage
tier's choices and selective-op too (acshim/planner/lockstep.py, explored.py): the first two steps run
every region recomputed with its input on disk (the least memory), then, each where its predicted
peak fits the budget, one step every region recomputed, one every region offloaded to disk, one
sampling selective-op; the plan may mix them with keep. A budget below full recompute's peak plans
(FSDP2; ZeRO-3 and FSDP1 exact and within budget with these choices offered: test_budget_ranks.py,
below); every rank's steps from the first one stay within it by the kernel's VmHWM, and the full
weights equal the same engine's without checkpointing bitwise (dropout on, 2 gloo ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from acshim.planner.profile import Profile
from acshim.planner.solver import rounded_peak

SHARDED = str(Path(__file__).resolve().parent / "scripts" / "sharded_budget.py")
STORAGE = ("offload:disk", "recompute+offload:disk")
EXPLORED = 5
"""Steps explored before the plan, at most: two recompute+offload:disk, one recomputed, one offloaded,
one sampling selective-op."""


def assert_predicted(result: dict) -> None:
    """The plan's predicted peak within 10% (or 2 MiB) of its verified step's, as measured on the
    largest rank (issue 26.2); ``measured`` ends with the verification of the plan run."""
    verified = result["measured"][-1]
    assert abs(result["predicted"] - verified) <= max(0.10 * verified, 2 << 20), result


@pytest.mark.parametrize(("engine", "blocks", "budget"), [
    ("fsdp2", "16", "68MiB"),   # full recompute peaks near 73 MiB here, the least plan near 58 MiB
    # ZeRO-3 is left out: its least plan was predicted at 75-94 MiB in three runs of the 12-block model
    # (its parameters prefetched in some steps and not others count at every step's start), against
    # full recompute's 96 MiB: no budget between them plans every time (docs/planner.md, Sharded)
])
def test_budget_below_full_recompute_plans_with_the_storage_tier_within_it_from_the_first_step_and_exactly(
        launch, torchrun, tmp_path, engine: str, blocks: str, budget: str) -> None:
    """Full recompute would not fit: its step is not run (nor the selective sample, which holds
    more), recompute's numbers are taken from the recompute+offload steps, and every step of every
    rank, the explored ones included, peaks within the budget by VmHWM."""
    path = tmp_path / "plan.json"
    command = torchrun("-m", "acshim", "run", "--budget", budget, "--plan-file", str(path), SHARDED,
                       "--engine", engine, "--blocks", blocks, "--rows", ",".join(["2048"] * (EXPLORED + 2)))
    result = launch(command, timeout=400)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = result.results
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["equal"] and r["finite"] for r in ranks), ranks       # bitwise, as without checkpointing
    assert ranks[0]["choices"] == ranks[1]["choices"], ranks            # one plan, rank 0's
    assert set(ranks[0]["choices"]) & set(STORAGE), ranks               # the storage tier made it fit
    profile = Profile.from_json(json.loads(path.read_text())["profile"])
    every_recomputed = rounded_peak(profile, ["recompute"] * len(profile.blocks))
    assert every_recomputed > ranks[0]["budget"], profile.blocks         # full recompute alone would not fit
    assert "recompute taken from recompute+offload:disk" in profile.method, profile.method
    for r in ranks:
        assert r["skipped"][:1] == ["recompute"] and "sampled" in r["skipped"], r   # predicted over: not run
        assert r["explored"] == EXPLORED - len(r["skipped"]), r
        assert len(r["measured"]) == r["explored"] + 1, r               # then one verification
        assert max(r["peaks"]) <= r["budget"], r                         # every step within, from the first, by VmHWM
        assert_predicted(r)
    assert "(0." in result.stderr and "of the budget, within it)" in result.stderr, result.stderr[-3000:]


def test_fsdp1_ranks_plan_on_their_own_steps_within_budget_and_train_exactly(launch, torchrun) -> None:
    """FSDP1 (``FullyShardedDataParallel`` per block and root, ``use_orig_params``: each rank's
    parameter shards have their own shapes, so rank 0's model signature is every rank's) is planned
    in lock-step like FSDP2: one plan, within the budget from its first step, bitwise exact."""
    command = torchrun("-m", "acshim", "run", "--budget", "0.6", SHARDED, "--engine", "fsdp1",
                       "--rows", ",".join(["2048"] * (EXPLORED + 2)))
    result = launch(command, timeout=400)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = result.results
    assert all(r["equal"] and r["finite"] for r in ranks), ranks
    assert ranks[0]["choices"] == ranks[1]["choices"] and "choices" in ranks[0], ranks
    assert set(ranks[0]["choices"]) != {"recompute"}, ranks             # the budget left room to keep or offload
    for r in ranks:
        assert max(r["peaks"][r["explored"]:]) <= r["budget"], r


@pytest.mark.parametrize("engine", ["fsdp2", "zero3"])
def test_sharded_model_is_offered_selective_op_sampled_on_its_last_block_within_the_budget(
        launch, torchrun, tmp_path, engine: str) -> None:
    """Selective-op on a sharded model: after the storage choices' steps, one step runs the last
    block ``selective`` (its saved matmul outputs counted) and the one before it ``selective-alt``
    where the budget leaves room, the rest recomputed; the other blocks of the kind take the sampled
    block's difference from recompute. The sampled step stays within the budget (its predicted peak
    decides how many blocks it samples), the plan is rank 0's on both ranks, and the weights equal
    the engine's without checkpointing bitwise. ZeRO-3 gathers each block's parameters inside its
    region, again in the recompute where the forward found them prefetched: those gathers are
    recomputed (torch's own selective checkpoint raises "aten.cat.out encountered during backward
    but not found in storage" there)."""
    path = tmp_path / "plan.json"
    command = torchrun("-m", "acshim", "run", "--budget", "0.75", "--plan-file", str(path), SHARDED,
                       "--engine", engine, "--rows", ",".join(["2048"] * (EXPLORED + 2)))
    result = launch(command, timeout=400)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = result.results
    assert all(r["equal"] and r["finite"] for r in ranks), ranks
    assert ranks[0]["choices"] == ranks[1]["choices"], ranks
    profile = json.loads(path.read_text())["profile"]
    assert "selective" in profile["choices"], profile["choices"]     # sampled on every rank, offered
    assert "one region of each kind selective" in profile["method"], profile["method"]
    for r in ranks:
        assert len(r["measured"]) == EXPLORED + 1, r                  # the sampled step ran
        assert max(r["peaks"]) <= r["budget"], r                       # it too within the budget, by VmHWM
        if engine == "fsdp2":
            assert_predicted(r)
        else:
            # ZeRO-3's prediction is held to bound the verified step, not to 10% of it: what the
            # process holds when its first region starts was 1.8 MiB in the sampled step and 10.2 MiB
            # in the others (gathered parameters held or not), the largest counts for every plan:
            # predicted 77-99 MiB against 64-89 verified in runs of this script, up to 1.2x
            assert r["predicted"] >= r["measured"][-1], r
    blocks = profile["blocks"]
    assert all(b["held"]["recompute"] < b["held"]["selective"] < b["held"]["keep"] for b in blocks), blocks
