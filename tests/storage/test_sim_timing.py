"""The offload tier on a device that runs behind the host (issue 27 item 1), on the simulated CUDA
runtime's timed mode (``backends/simtime.py``): every copy and kernel lasts what a bandwidth model
says, on a virtual clock per stream, and the host's clock moves only by launches and by its waits.
These tests fail if the tier makes the host wait where it should not, or if prefetch does not hide
copy time when the link is fast enough to."""

from __future__ import annotations

import gc

import pytest
import torch

from acshim.backends.cuda import CudaBackend
from acshim.backends.simcuda import SimulatedCuda
from acshim.backends.simtime import BandwidthModel
from acshim.storage import offload
from acshim.storage.reaper import REAPER

from .conftest import assert_no_violations

ROWS, WIDTH = 64, 256
GROUP_BYTES = ROWS * WIDTH * 4


def _timed(model: BandwidthModel):
    sim = SimulatedCuda("lazy", timing=model)
    return sim, CudaBackend(torch.device("cpu"), runtime=sim)


def _chain(x: torch.Tensor, links: int = 12) -> torch.Tensor:
    """``links`` saved tensors of ``GROUP_BYTES`` each (every ``sin`` saves its input)."""
    h = x
    for _ in range(links):
        h = h.sin()
    return h.sum()


def test_the_timed_simulator_runs_the_device_behind_the_host():
    model = BandwidthModel(pinned_bytes_per_s=1e9, pageable_bytes_per_s=0.5e9, copy_latency_s=0.0, launch_s=1e-6)
    sim = SimulatedCuda("lazy", timing=model)
    side, timeline = sim.Stream(), sim.timeline
    device, pinned, host = sim.empty(10**6), sim.pin(10**6), sim.pageable(torch.empty(10**6, dtype=torch.uint8))
    start, end = sim.Event(), sim.Event()
    start.record(side)
    with sim.stream(side):
        sim.copy(pinned, device)  # 1 ms on the device, one launch (1 us) on the host
    end.record(side)
    assert timeline.host == pytest.approx(1e-6) and not end.query()  # the host runs ahead
    assert start.elapsed_time(end) == pytest.approx(1.001)  # milliseconds: the launch, then the copy
    end.synchronize()
    assert timeline.host == pytest.approx(1e-3 + 1e-6) and timeline.host_wait_s == pytest.approx(1e-3)
    assert end.query()
    with sim.stream(side):
        sim.copy(host, device)  # pageable: 2 ms, and the host waits for it
    assert timeline.host == pytest.approx(3e-3 + 2e-6) and timeline.host_wait_s == pytest.approx(3e-3)
    with sim.stream(side):
        sim.copy(pinned, device)
    nothing_done = sim.Event()
    nothing_done.record(side)
    with sim.stream(sim.Stream()):
        later = sim.empty(10**6)
    assert not nothing_done.query() and timeline.host < timeline.last_end[side.id]
    del later
    sim.drain()
    assert not sim.violations


def test_a_kernel_lasts_its_bytes_and_flops_and_waits_for_the_copy_it_reads():
    model = BandwidthModel(pinned_bytes_per_s=1e9, device_bytes_per_s=1e9, flops_per_s=1e12, kernel_floor_s=0.0,
                           copy_latency_s=0.0, launch_s=0.0)
    sim = SimulatedCuda("lazy", timing=model)
    side, timeline = sim.Stream(), sim.timeline
    pinned = sim.pin(4 * 256 * 256)
    pinned.view(torch.float32).fill_(1.0)
    loaded = sim.empty(4 * 256 * 256)
    with sim.stream(side):
        sim.copy(loaded, pinned)  # 262 us on the side stream
    landed = sim.Event()
    landed.record(side)
    sim.default_stream.wait_event(landed)
    with sim.compute():
        a = loaded.view(torch.float32).view(256, 256)
        b = a @ a  # 3 x 262144 bytes and 2 x 256^3 FLOPs: 786 us + 34 us, after the copy
    copy, matmul = 4 * 256 * 256 / 1e9, 3 * 4 * 256 * 256 / 1e9 + 2 * 256**3 / 1e12
    assert timeline.last_end[sim.default_stream.id] == pytest.approx(copy + matmul)
    assert timeline.stalls[sim.default_stream.id] == [(0.0, pytest.approx(copy))]  # the compute stream waited
    sim.default_stream.synchronize()
    assert torch.equal(b, torch.full((256, 256), 256.0))
    assert not sim.violations


SLOW_LINK = BandwidthModel(pinned_bytes_per_s=0.2e9)  # every copy out outlasts forward's compute


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_the_host_tier_never_makes_the_host_wait_while_the_device_lags(prefetch):
    sim, backend = _timed(SLOW_LINK)
    timeline = sim.timeline
    with sim.compute():
        x = torch.randn(ROWS, WIDTH, requires_grad=True)
        with sim.unchecked():
            expected = torch.autograd.grad(_chain(x), x)[0]
        with offload("host", prefetch, min_bytes=0, backend=backend) as scope:
            loss = _chain(x)
            before_end = timeline.host
        # the end of forward: the copies out are still running on the device, and the host goes on
        assert timeline.last_end[backend._d2h.id] > timeline.host + 6 * GROUP_BYTES / SLOW_LINK.pinned_bytes_per_s
        assert timeline.host_wait_s == 0.0, timeline.waits  # neither in forward nor at its end
        assert timeline.host - before_end < 1e-4
        got = torch.autograd.grad(loss, x)[0]
        assert timeline.host_wait_s == 0.0, timeline.waits  # backward waits on the device, never on the host
        assert timeline.last_end[sim.default_stream.id] > timeline.host  # the device is still behind
        assert torch.equal(got, expected)
        assert scope.stats.sent_out == scope.stats.fetched == 11 - prefetch  # x is a leaf; H groups stay
        del loss
        assert_no_violations(sim)
    backend.close()


def _backward_stall(prefetch: int, model: BandwidthModel) -> tuple[float, int, object]:
    """Seconds the compute stream waited for copies in during backward, groups fetched, the sim."""
    sim, backend = _timed(model)
    with sim.compute():
        x = torch.randn(ROWS, WIDTH, requires_grad=True)
        with sim.unchecked():
            expected = torch.autograd.grad(_chain(x), x)[0]
        with offload("host", prefetch, min_bytes=0, backend=backend) as scope:
            loss = _chain(x)
        sim.default_stream.synchronize()  # every copy out landed: backward's stalls are the copies in
        start = sim.timeline.host
        got = torch.autograd.grad(loss, x)[0]
        assert torch.equal(got, expected)
        del loss
        gc.collect()
        assert REAPER.settle()
        report = sim.timeline.report(sim.default_stream.id, [backend._d2h.id, backend._h2d.id], since=start)
        assert_no_violations(sim)
    backend.close()
    return report["compute_stall_s"], scope.stats.fetched, report


# Host launches as slow as the device's kernels (the host does not run far ahead) and a copy in of one
# group (64 KiB at 2 GB/s: 33 us) shorter than backward's compute on a group (two 128 KiB kernels at
# 2 GB/s: 131 us): the link allows hiding every copy in behind the previous group's compute.
FAST_ENOUGH = BandwidthModel(pinned_bytes_per_s=2e9, device_bytes_per_s=2e9, launch_s=60e-6)


def test_prefetch_hides_copy_time_when_the_link_allows():
    copy = FAST_ENOUGH.copy_seconds(GROUP_BYTES, "pinned")
    stall0, fetched, _ = _backward_stall(0, FAST_ENOUGH)
    assert fetched == 11  # x is a leaf: kept
    assert stall0 >= 0.5 * fetched * copy, (stall0, fetched * copy)  # without prefetch, compute waits for copies
    for prefetch in (1, 2):
        stall, fetched, report = _backward_stall(prefetch, FAST_ENOUGH)
        assert fetched == 11 - prefetch  # the last H groups stay on the device
        assert stall <= 0.1 * stall0, (prefetch, stall, stall0, report)  # each copy in landed before its use


def test_prefetch_cannot_hide_a_link_slower_than_compute_but_still_shortens_the_wait():
    slow = BandwidthModel(pinned_bytes_per_s=0.2e9, device_bytes_per_s=2e9, launch_s=60e-6)
    stall0, _, _ = _backward_stall(0, slow)
    stall2, _, report = _backward_stall(2, slow)
    assert 0 < stall2 < stall0, (stall2, stall0)
    assert report["overlap"] < 1.0
