"""DeepSpeed ``partition_activations`` across a model-parallel group of 2 gloo ranks (Megatron-style
``mpu``), with contiguous buffers and ``cpu_checkpointing``, reentrant and non-reentrant: the same
script (scripts/deepspeed_partition.py) under real DeepSpeed 0.19.8 and under ``acshim run``, in one
launch each.

- gradients bitwise equal to the run without checkpointing in every case, dropout inside
  ``get_cuda_rng_tracker().fork()`` included, and to real DeepSpeed where it is exact (without
  dropout; measured here: with Megatron's pattern, where each block's output is all-reduced so every
  rank holds the same checkpoint inputs, real DeepSpeed is exact with dropout too. Partitioning
  inputs that differ across ranks, e.g. dropout on the rank's own stream right before a checkpoint
  boundary, is wrong in both: the gather mixes the ranks' halves);
- bytes held for backward per rank: the partitioned checkpoint inputs are half the unpartitioned
  ones, as upstream's;
- upstream's hollowing (the caller's input reads shape ``()`` until backward gathers it back whole)
  and the mp edge cases (size not divisible by mp: AssertionError; fewer elements than ranks and
  integer tensors kept whole; IndexError past ``num_checkpoints``; buffers dropped by ``reset()``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

ACSHIM = str(Path(sys.executable).with_name("acshim"))
SCRIPT = str(Path(__file__).resolve().parent / "scripts" / "deepspeed_partition.py")
ENV = {"DS_ACCELERATOR": "cpu"}
PARTITIONED = ("partition", "contiguous", "cpu", "cpu_contiguous")
MODES = ("checkpoint", "non_reentrant_checkpoint")


def _results(launch, torchrun, under_acshim: bool) -> list[dict]:
    prefix = ("--no-python", ACSHIM, "run") if under_acshim else ()
    outcome = launch(torchrun(*prefix, SCRIPT), env=ENV, timeout=240)
    assert outcome.returncode == 0, outcome.stderr[-4000:]
    results = [result["results"] for result in outcome.results]
    assert len(results) == 2
    if under_acshim:
        assert len(outcome.region_counts()) == 2  # both ranks ran on the engine
    return results


def test_partition_across_two_ranks_equals_no_checkpointing_and_real_deepspeed(launch, torchrun) -> None:
    real = _results(launch, torchrun, under_acshim=False)
    ours = _results(launch, torchrun, under_acshim=True)
    for rank, (expected, actual) in enumerate(zip(real, ours)):
        for dropout in ("0.0", "0.1"):
            reference = expected[f"none/{dropout}"]
            assert actual[f"none/{dropout}"] == reference, rank
            unpartitioned = actual[f"plain/checkpoint/{dropout}"]["held"]
            for mode in MODES:
                assert actual[f"plain/{mode}/{dropout}"] == expected[f"plain/{mode}/{dropout}"], (rank, mode)
                for case in PARTITIONED:
                    key = f"{case}/{mode}/{dropout}"
                    assert actual[key]["grads"] == reference["grads"], (rank, key)  # exact, dropout or not
                    if dropout == "0.0":  # where upstream is exact, it is the same
                        assert expected[key]["grads"] == reference["grads"], (rank, key)
                    # upstream's hollowing: () after forward, whole again after backward
                    assert actual[key]["stem_shapes"] == expected[key]["stem_shapes"] == [[], [8, 32]], key
                    # each rank holds half of every checkpoint input (4 x 8x32 float32), no more than upstream
                    assert actual[key]["held"] <= expected[key]["held"], key
                    assert abs(actual[key]["held"] - unpartitioned / 2) <= 128, (key, actual[key]["held"])
        edges, upstream_edges = actual["edges"], expected["edges"]
        assert edges["past_num_checkpoints"].startswith(upstream_edges["past_num_checkpoints"])
        edges.pop("past_num_checkpoints"), upstream_edges.pop("past_num_checkpoints")
        assert edges == upstream_edges
        assert edges["odd"] == "AssertionError: Doesn't handle if partition activation if item is not divisible by mp size"
        assert edges["small_shapes_after_forward"] == [[], [1], [5]]
        assert edges["small_shapes_after_backward"] == [[4, 5], [1], [5]]
