"""DDP, FSDP1 and FSDP2 on real gloo ranks (torchrun, 2 processes): every checkpointing dialect, run
under ``acshim run``, gives gradients and losses bitwise equal to the same engine without
checkpointing, including reentrant regions with DDP's ``find_unused_parameters`` (where torch's
reentrant checkpoint fails with "Expected to mark a variable ready only once")."""

from __future__ import annotations

import sys
from pathlib import Path

ACSHIM = str(Path(sys.executable).with_name("acshim"))
SCRIPT = str(Path(__file__).resolve().parent / "scripts" / "data_parallel_equivalence.py")


def _assert_all_equal(launch_result, expected_cases: int) -> None:
    assert launch_result.returncode == 0, launch_result.stderr[-4000:]
    results = launch_result.results
    assert [r["rank"] for r in results] == [0, 1]
    for result in results:
        assert len(result["results"]) == expected_cases
        assert all(outcome == "equal" for outcome in result["results"].values()), result


def test_ddp_gradients_bitwise_equal_for_every_dialect_and_ddp_setting(launch, torchrun) -> None:
    result = launch(torchrun("--no-python", ACSHIM, "run", SCRIPT, "--engine", "ddp"))
    _assert_all_equal(result, expected_cases=4 * 3)
    # Both ranks ran on the engine: 4 blocks x 2 steps x 3 checkpointed dialects x 3 settings
    # forwards each (the deepspeed dialect calls checkpoint in forward), recomputed in backward.
    counts = result.region_counts()
    assert len(counts) == 2, result.stderr[-2000:]
    assert counts == ["acshim: 96 region forwards, 96 recomputes"] * 2, counts


def test_fsdp2_gradients_bitwise_equal_for_every_dialect(launch, torchrun) -> None:
    result = launch(torchrun("--no-python", ACSHIM, "run", SCRIPT, "--engine", "fsdp2"))
    _assert_all_equal(result, expected_cases=4)


def test_fsdp1_flat_parameters_gradients_bitwise_equal_for_every_dialect(launch, torchrun) -> None:
    result = launch(torchrun("--no-python", ACSHIM, "run", SCRIPT, "--engine", "fsdp1", "--settings", "flat_params"))
    _assert_all_equal(result, expected_cases=4)


def test_fsdp1_original_parameters_gradients_bitwise_equal_for_non_reentrant_dialects(launch, torchrun) -> None:
    """use_orig_params=True with reentrant regions is left out: torch's own reentrant checkpoint
    returns no gradients there, and FSDP1's backward prefetch then issues collectives in another
    order on each rank (docs/distributed.md)."""
    result = launch(torchrun("--no-python", ACSHIM, "run", SCRIPT, "--engine", "fsdp1", "--settings", "orig_params",
                             "--dialects", "torch_non_reentrant,fairscale"))
    _assert_all_equal(result, expected_cases=2)
