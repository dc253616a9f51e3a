"""Megatron-core 0.16.1 ``TransformerConfig(distribute_saved_activations=True)`` with tensor-parallel
size 2, on 2 real gloo ranks (torchrun, CPU): each full-recompute region keeps 1/TP of its first
input on acshim's partition engine and all-gathers it before the recompute
(scripts/megatron_distribute.py). Upstream cannot run this on CPU: ``split_tensor_into_1d_equal_chunks``
and ``gather_split_1d_tensor`` allocate on ``torch.cuda.current_device()``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="absent upstream: megatron-core is not installed (pip install 'acshim[megatron]')")

SCRIPT = str(Path(__file__).resolve().parent / "scripts" / "megatron_distribute.py")
LAYERS, TP = 4, 2
FULL = 64 * 2 * 64 * 4  # one region's fp32 [s, b, h] input


def test_distribute_saved_activations_splits_the_input_across_tp_ranks_bitwise(launch, torchrun) -> None:
    outcome = launch(torchrun(SCRIPT), timeout=240)
    assert outcome.returncode == 0, outcome.stderr[-4000:]
    results = outcome.results
    assert [result["tp_rank"] for result in results] == [0, 1]
    for result in results:
        assert result["bitwise"]  # gradients equal to distribute_saved_activations=False, dropout on
        assert result["shards"]["plain"] == []
        # each of the 4 regions (uniform, one layer each) kept half of its input on each rank
        assert result["shards"]["distributed"] == [[FULL // TP, FULL]] * LAYERS
        # held for backward: the 3 inputs made in forward (the first is the caller's) were kept whole;
        # now 4 halves (and 4 emptied 0-dim tensors)
        held = result["held"]
        assert held["plain"] - held["distributed"] >= (LAYERS - 1) * FULL - LAYERS * FULL // TP - 4 * LAYERS
        # the caller's input is emptied until backward gathers it back, as upstream shrinks it
        assert result["shapes"] == [[], [64, 2, 64]]
        assert "not divisible by the tensor-parallel size 2" in result["uneven"]
