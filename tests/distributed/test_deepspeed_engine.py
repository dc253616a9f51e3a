"""The DeepSpeed engine (deepspeed.initialize, ZeRO stages 0-3, DeepSpeed's CPU accelerator,
gloo, 2 ranks): a script using deepspeed.checkpointing.checkpoint runs under ``acshim run`` with
losses and parameters after two optimizer steps bitwise equal to real DeepSpeed 0.19.8 running
the same script without checkpointing (dropout on); with dropout off, equal to real DeepSpeed's
own checkpointing too. (With dropout on, real DeepSpeed's checkpointed run differs from its own
run without checkpointing on CPU; acshim does not.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

ACSHIM = str(Path(sys.executable).with_name("acshim"))
SCRIPT = str(Path(__file__).resolve().parent / "scripts" / "deepspeed_engine.py")
ENV = {"DS_ACCELERATOR": "cpu"}


def _results(launch, torchrun, *args: str, under_acshim: bool) -> list[dict]:
    prefix = ("--no-python", ACSHIM, "run") if under_acshim else ()
    outcome = launch(torchrun(*prefix, SCRIPT, *args), env=ENV, timeout=240)
    assert outcome.returncode == 0, outcome.stderr[-4000:]
    results = [result["results"] for result in outcome.results]
    assert len(results) == 2
    assert sorted(results[0]) == ["0", "1", "2", "3"]
    if under_acshim and "deepspeed" in args:
        # 3 blocks x 2 steps x 4 stages, each forward recomputed once in backward, on both ranks
        assert outcome.region_counts() == ["acshim: 24 region forwards, 24 recomputes"] * 2
    return results


def test_zero_stages_under_acshim_equal_deepspeed_without_checkpointing_dropout_on(launch, torchrun) -> None:
    expected = _results(launch, torchrun, "--checkpoint", "none", "--dropout", "0.1", under_acshim=False)
    actual = _results(launch, torchrun, "--checkpoint", "deepspeed", "--dropout", "0.1", under_acshim=True)
    assert actual == expected


def test_zero_stages_under_acshim_equal_real_deepspeed_checkpointing_dropout_off(launch, torchrun) -> None:
    expected = _results(launch, torchrun, "--checkpoint", "deepspeed", "--dropout", "0", under_acshim=False)
    actual = _results(launch, torchrun, "--checkpoint", "deepspeed", "--dropout", "0", under_acshim=True)
    assert actual == expected
