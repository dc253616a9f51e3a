"""``acshim run --report``'s rows: one per region, named by the block's class and index whichever
way the region was made (the module itself, a bound forward, a closure around the block, a group of
layers), stable from step to step."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

import acshim
from acshim import region
from acshim.report import RegionRecorder


@pytest.fixture
def recorder() -> Iterator[RegionRecorder]:
    previous, region.STATS.recorder = region.STATS.recorder, RegionRecorder()
    try:
        yield region.STATS.recorder
    finally:
        region.STATS.recorder = previous


def _rows(recorder: RegionRecorder) -> list[tuple[str, int, int]]:
    return [(entry.name, entry.forwards, entry.recomputes) for entry in recorder.entries.values()]


def _blocks() -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))


def test_a_closure_per_block_is_that_blocks_region(recorder: RegionRecorder) -> None:
    """DeepSpeed's ``custom(module)`` idiom: one closure code for every block, one row per block."""
    blocks = _blocks()

    def custom(module: nn.Module):
        def forward(x: torch.Tensor) -> torch.Tensor:
            return module(x)
        return forward

    for _ in range(2):
        x = torch.randn(2, 8, requires_grad=True)
        for block in blocks:
            x = acshim.checkpoint(custom(block), x, use_reentrant=True)
        x.sum().backward()
    assert _rows(recorder) == [(f"Sequential#{i}", 2, 2) for i in range(3)]


def test_closures_over_index_ranges_and_sliced_containers_are_stable_regions(recorder: RegionRecorder) -> None:
    """Megatron's ``custom(start, end)`` over the whole stack, and a container sliced anew each step
    (``checkpoint_sequential(model.h[1:], ...)``): one row per range, the same rows every step."""
    blocks = _blocks()

    def custom(start: int, end: int, layers: nn.ModuleList):
        def forward(x: torch.Tensor) -> torch.Tensor:
            for layer in layers[start:end]:
                x = layer(x)
            return x
        return forward

    for _ in range(2):
        x = torch.randn(2, 8, requires_grad=True)
        x = acshim.checkpoint(custom(0, 1, blocks), x)
        x = acshim.checkpoint(custom(0, 2, blocks[1:]), x)  # a fresh ModuleList each step
        x.sum().backward()
    assert _rows(recorder) == [("ModuleList#0", 2, 2), ("ModuleList#1", 2, 2)]


def test_module_and_bound_forward_of_one_block_share_its_row(recorder: RegionRecorder) -> None:
    blocks = _blocks()
    x = torch.randn(2, 8, requires_grad=True)
    y = acshim.checkpoint(blocks[0], x) + acshim.checkpoint(blocks[0].forward, x)
    y.sum().backward()
    assert _rows(recorder) == [("Sequential#0", 2, 2)]
