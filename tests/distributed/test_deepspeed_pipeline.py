"""Real DeepSpeed pipeline parallelism (``PipelineModule`` of 2 stages with a ``TiedLayerSpec``,
``engine.train_batch()``, DeepSpeed's CPU accelerator, gloo, 2 ranks) under ``acshim run``: with
``activation_checkpoint_interval`` 0, 1 and 2, and ``checkpointable_layers``, the checkpoints the
PipelineModule makes run on acshim's engine, and losses and each stage's parameters after two
optimizer steps are bitwise those of real DeepSpeed without acshim (dropout on)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

ACSHIM = str(Path(sys.executable).with_name("acshim"))
SCRIPT = str(Path(__file__).resolve().parent / "scripts" / "deepspeed_pipeline.py")
ENV = {"DS_ACCELERATOR": "cpu"}
CASES = ("0", "1", "2", "1-Block")  # interval[-checkpointable layer class]


def test_pipeline_module_checkpoint_intervals_under_acshim_equal_real_deepspeed(launch, torchrun) -> None:
    args = (SCRIPT, "--dropout", "0.1", "--cases", ",".join(CASES))
    real = launch(torchrun(*args), env=ENV, timeout=240)
    assert real.returncode == 0, real.stderr[-4000:]
    shimmed = launch(torchrun("--no-python", ACSHIM, "run", *args), env=ENV, timeout=240)
    assert shimmed.returncode == 0, shimmed.stderr[-4000:]
    expected, actual = ([r["results"] for r in run.results] for run in (real, shimmed))
    assert [sorted(r) for r in actual] == [sorted(CASES)] * 2
    assert [r["0"]["stage"] for r in actual] == [0, 1]
    assert actual == expected
    for rank in actual:  # checkpointing changes nothing: every interval trains as interval 0
        assert all(rank[case] == rank["0"] for case in CASES), rank
    # per stage, 2 steps x 2 micro-batches x regions per forward. Stage 0 [tied proj, Block, Mixer,
    # Block]: interval 1: 4, interval 2: 2, checkpointable_layers=["Block"]: 2. Stage 1 [Block, Mixer,
    # Block, tied forward_fn (a function, never checkpointable)]: 3, 2 and 2.
    assert sorted(shimmed.region_counts()) == ["acshim: 28 region forwards, 28 recomputes",
                                               "acshim: 32 region forwards, 32 recomputes"]
