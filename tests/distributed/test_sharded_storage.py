"""Sharded models (FSDP2, ZeRO-3) under ``torchrun -m acshim run --budget`` are offered the storage
tier's choices and selective-op too (acshim/planner/lockstep.py, explored.py): after the recomputed steps, one step
runs every region offloaded to disk and one recomputed with its input on disk, and the plan may mix
them with keep and recompute. A budget below full recompute's peak, refused before, now plans (FSDP2;
ZeRO-3 and FSDP1 exact and within budget with these choices offered: test_budget_ranks.py, below); every
rank's steps from the first planned one stay within it by the kernel's VmHWM, and the full weights
equal the same engine's without checkpointing bitwise (dropout on, 2 gloo ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

SHARDED = str(Path(__file__).resolve().parent / "scripts" / "sharded_budget.py")
STORAGE = ("offload:disk", "recompute+offload:disk")
EXPLORED = 5
"""Steps explored before the plan: two recomputed, one per storage choice, one sampling selective-op."""


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
def test_budget_below_full_recompute_plans_with_the_storage_tier_within_it_and_exactly(
        launch, torchrun, engine: str, blocks: str, budget: str) -> None:
    command = torchrun("-m", "acshim", "run", "--budget", budget, SHARDED, "--engine", engine, "--blocks", blocks,
                       "--rows", ",".join(["2048"] * (EXPLORED + 2)))
    result = launch(command, timeout=400)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = result.results
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["equal"] and r["finite"] for r in ranks), ranks       # bitwise, as without checkpointing
    assert ranks[0]["choices"] == ranks[1]["choices"], ranks            # one plan, rank 0's
    assert set(ranks[0]["choices"]) & set(STORAGE), ranks               # the storage tier made it fit
    for r in ranks:
        # explored steps (the sampled one skipped where no selective block fits, none then offered)
        assert r["explored"] == EXPLORED - 1 + bool({"selective", "selective-alt"} & set(r["offered"])), r
        assert len(r["measured"]) == r["explored"] + 1, r               # then one verification
        assert max(r["measured"][:2]) > r["budget"], r                  # full recompute alone would not fit
        assert max(r["peaks"][r["explored"]:]) <= r["budget"], r         # every planned step within, by VmHWM
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


def test_fsdp2_is_offered_selective_op_sampled_on_its_last_block_within_the_budget(launch, torchrun, tmp_path) -> None:
    """Selective-op on a sharded model: after the storage choices' steps, one step runs the last
    block ``selective`` (its saved matmul outputs counted) and the one before it ``selective-alt``
    where the budget leaves room, the rest recomputed; the other blocks of the kind take the sampled
    block's difference from recompute. The sampled step stays within the budget (its predicted peak
    decides how many blocks it samples), the plan is rank 0's on both ranks, and the weights equal
    FSDP2's without checkpointing bitwise."""
    path = tmp_path / "plan.json"
    command = torchrun("-m", "acshim", "run", "--budget", "0.75", "--plan-file", str(path), SHARDED,
                       "--engine", "fsdp2", "--rows", ",".join(["2048"] * (EXPLORED + 2)))
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
        assert_predicted(r)
    blocks = profile["blocks"]
    assert all(b["held"]["recompute"] < b["held"]["selective"] < b["held"]["keep"] for b in blocks), blocks
