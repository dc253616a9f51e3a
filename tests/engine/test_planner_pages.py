"""An allocation that is not written commits no pages on the CPU (issue 26 item 1): the planner's
guard does not size ``torch.empty`` before it runs, and its live-bytes count charges such a buffer
by the pages resident in it (``mincore``), measured after every operator that uses it. TRL's
chunked log-prob asks for 120 MiB of scratch and writes a column slice of it."""

from __future__ import annotations

import sys

import pytest
import torch

from acshim.planner.pages import resident_bytes, uncommitted
from acshim.planner.tracker import LiveBytes, excluded_keys

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore(2) on Linux")


def test_resident_bytes_follow_the_pages_written() -> None:
    buffer = torch.empty(256, 32768)  # 32 MiB asked for, a mapping of its own (over any mmap threshold)
    storage = buffer.untyped_storage()
    assert resident_bytes(storage) < 1 << 20
    buffer[:, :512].fill_(1.0)  # 2 KiB of each 128 KiB row: one page per row
    assert 256 * 4096 <= resident_bytes(storage) <= 2 * 256 * 4096 + (1 << 16)
    buffer.fill_(2.0)
    assert resident_bytes(storage) == storage.nbytes()


def test_uninitialised_cpu_factories_only() -> None:
    empty, zeros = torch.ops.aten.empty.memory_format, torch.ops.aten.zeros.default
    assert uncommitted(empty, ([4, 4],), {"device": torch.device("cpu")})
    assert not uncommitted(zeros, ([4, 4],), {"device": torch.device("cpu")})
    assert not uncommitted(empty, ([4, 4],), {"device": torch.device("meta")})


def test_live_bytes_charge_a_scratch_buffer_by_what_is_written() -> None:
    """TRL's pattern: a (960, 32768) float32 scratch buffer (120 MiB) into whose vocabulary-wide
    column slice a matmul writes. Counted by the pages written (one or two per row), not 120 MiB;
    a buffer written whole is counted whole."""
    hidden, weight = torch.randn(960, 64), torch.randn(512, 64)
    with LiveBytes(excluded_keys(torch.nn.Module(), hidden, weight)) as tracker:  # inputs are not counted
        scratch = torch.empty(960, 32768)
        torch.mm(hidden, weight.t(), out=scratch[:, :512])
        logits = scratch[:, :512].sum()
        del scratch
        tracker.mark("end")  # sweeps what was freed
    series = tracker.series(set())
    assert 960 * 4096 <= max(series) <= 2 * 960 * 4096 + (1 << 20), max(series)
    assert series[-1] == logits.untyped_storage().nbytes()  # the scratch buffer's bytes all given back
    with LiveBytes(set()) as tracker:
        whole = torch.empty(960, 4096)
        whole.fill_(1.0)
    assert max(tracker.series(set())) == whole.untyped_storage().nbytes()


def test_fake_step_counts_no_page_of_an_unwritten_buffer() -> None:
    """The step on fake tensors (``estimate.step_peak``, a lower bound of no checkpointing's peak)
    has no pages to read: an unwritten buffer counts nothing there, even once an operator writes into
    it (counted whole, TRL's 120 MiB scratch buffer made that bound 2.3x the peak the process has)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        hidden, weight = torch.randn(960, 64), torch.randn(512, 64)
        tracker = LiveBytes(excluded_keys(torch.nn.Module(), hidden, weight))
        with tracker:
            scratch = torch.empty(960, 32768)
            torch.mm(hidden, weight.t(), out=scratch[:, :512])
            written = torch.ones(960, 512)
        series = tracker.series(set())
        tracker.release()
    assert max(series) == written.numel() * 4, max(series)
