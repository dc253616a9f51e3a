"""What the planner charges an offloaded block measured alone (planner/costs.py): its copies'
processor time, its backward's prefetch waits and its operators' slowdown beside its copies."""

from __future__ import annotations

import time

import pytest
import torch

from acshim.planner import plan
from acshim.planner.costs import OpTimes, RunTime
from acshim.storage.disk import DiskTier
from acshim.testing import GPT, seeded


def test_an_offloaded_run_alone_is_charged_its_waits_and_its_slowdown_against_the_kept_run() -> None:
    kept = RunTime(wall=0.12, own=0.0, durations=[("mm", 0.05), ("add", 0.01)])
    moved = RunTime(wall=0.25, own=0.0, durations=[("mm", 0.06), ("add", 0.012)], other_cpu=0.03, waits=0.008)
    times = OpTimes()
    times.observe_run(kept)
    times.observe_run(moved, moves_data=True)
    least, between = 0.06, 0.06  # the operators at their least; keep's time between operators, per operator
    assert moved.slowdown(times) == pytest.approx(1.2) and kept.slowdown(times) == pytest.approx(1.0)
    assert moved.estimate(times, moves_data=True, alone=True) == pytest.approx(least + between + 0.03 + 0.008)
    charged = moved.estimate(times, moves_data=True, alone=True, kept=kept)
    assert charged == pytest.approx(least + between + 0.03 + 0.008 + 0.2 * least)
    # as slow as the kept run: the machine was slow, not the copies; nothing more is charged
    assert moved.estimate(times, moves_data=True, alone=True, kept=moved) == pytest.approx(least + between + 0.038)
    # a run that moves nothing is charged none of it
    assert moved.estimate(times, alone=True, kept=kept) == pytest.approx(least + between)


def _offload_seconds(monkeypatch: pytest.MonkeyPatch, read_delay: float) -> float:
    if read_delay:
        slow_read = DiskTier.read

        def read(self, slot):
            time.sleep(read_delay)
            return slow_read(self, slot)

        monkeypatch.setattr(DiskTier, "read", read)
    model = seeded(lambda: GPT(layers=4, width=64, heads=4, seq=32, vocab=128))
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(3))
    found = plan(model, ids, budget=0.5, choices=["keep", "offload"], storage="disk", memory="tensors", verify=False)
    monkeypatch.undo()
    return found.profile.blocks[0].seconds["offload:disk"]


def test_a_tier_whose_reads_are_late_makes_offloading_a_block_estimated_slower_by_its_waits(monkeypatch) -> None:
    """A block's backward that waits for reads its prefetch had not landed runs that much slower in
    a step too: the estimate charges those waits (before, only processor time was charged, and a
    sleeping read cost nothing)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        prompt = _offload_seconds(monkeypatch, 0.0)
        late = _offload_seconds(monkeypatch, 0.02)
    finally:
        torch.set_num_threads(threads)
    # the block saves several tensors; with two prefetched ahead, most of its reads come late
    assert late - prompt > 0.05, (prompt, late)
