"""The offload path as a GPU runs it (issue 27), proved on the simulated CUDA runtime: one test (or
more) per finding of the issue's review, each red on the backend before its fix, and the
simulator's new rules (caching allocator pools, host memory kinds, device guard, capture) checked
on their own. ``tests/tools/mutate_cuda.py`` deletes each new ordering, release, unregister, device
guard and capture check of ``backends/cuda.py`` and checks that ``tests/storage`` turns red."""

from __future__ import annotations

import errno
import gc
import threading

import pytest
import torch
from torch import nn

from acshim.backends.cuda import CudaBackend
from acshim.backends.runtime import HOST_REGISTER_PORTABLE, TorchCudaRuntime
from acshim.backends.simcuda import SimulatedCuda
from acshim.storage import OffloadIOError, offload
from acshim.storage.host import HostTier
from acshim.storage.reaper import REAPER

from .conftest import assert_no_violations, simulated_cuda

ORDERS = ["lazy", "random"]
ROWS, WIDTH = 64, 256
GROUP_BYTES = ROWS * WIDTH * 4


@pytest.fixture(params=ORDERS)
def sim_cuda(request):
    sim, backend = simulated_cuda(request.param, seed=11)
    with sim.compute():
        yield sim, backend
    assert_no_violations(sim)
    backend.close()


def _chain(x: torch.Tensor, links: int = 12) -> torch.Tensor:
    """``links`` saved tensors of ``GROUP_BYTES`` each (every ``sin`` saves its input)."""
    h = x
    for _ in range(links):
        h = h.sin()
    return h.sum()


def _settled(sim) -> None:
    gc.collect()
    assert REAPER.settle()
    sim.check()


# -------------------------------------------- 1. reload buffers bounded by the horizon, in reserved memory


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("storage", ["host", "disk"])
def test_reload_buffers_stay_within_the_horizon_in_reserved_memory(sim_cuda, storage, prefetch, disk_dir):
    sim, backend = sim_cuda
    x = torch.randn(ROWS, WIDTH, requires_grad=True)
    with sim.unchecked():
        expected = torch.autograd.grad(_chain(x), x)[0]
    with offload(storage, prefetch, disk_dir, min_bytes=0, backend=backend) as scope:
        loss = _chain(x)
    got = torch.autograd.grad(loss, x)[0]
    assert torch.equal(got, expected)
    del loss
    _settled(sim)
    fetched = scope.stats.fetched
    assert fetched >= 8, scope.stats
    # No host wait happens in backward (a device a whole backward behind): blocks given back through
    # record_stream could not be reused, and reserved memory would reach ``fetched`` buffers.
    assert sim.peak_reserved_bytes <= (prefetch + 1) * GROUP_BYTES, (sim.peak_reserved_bytes, prefetch)
    assert sim.allocated_bytes == 0  # every reload buffer was given back


# ------------------------------------------------------------------ 2. no host wait at the end of forward


def test_the_host_tier_does_not_wait_for_its_copies_at_the_end_of_forward(sim_cuda):
    sim, backend = sim_cuda
    x = torch.randn(ROWS, WIDTH, requires_grad=True)
    with sim.unchecked():
        expected = torch.autograd.grad(_chain(x), x)[0]
    before = dict(sim.synchronized_by)
    with offload("host", 1, min_bytes=0, backend=backend) as scope:
        loss = _chain(x)
    assert scope.stats.sent_out > 0
    assert sim.synchronized_by == before  # forward ended without blocking the host on the device
    assert torch.equal(torch.autograd.grad(loss, x)[0], expected)


def test_the_disk_tier_still_reports_a_failed_write_at_the_end_of_forward(sim_cuda, disk_dir):
    from .test_simulated_cuda import _GatedIO

    sim, backend = sim_cuda
    x = torch.randn(ROWS, WIDTH, requires_grad=True)
    with sim.unchecked():
        expected = torch.autograd.grad(_chain(x, 4), x)[0]
    scope = offload("disk", 0, disk_dir, min_bytes=0, backend=backend)
    gated = scope._tier.io = _GatedIO(scope._tier.io, fail_writes=errno.ENOSPC)
    gated.gate.clear()  # the writes fail once forward has saved everything
    with pytest.raises(OffloadIOError), scope:
        loss = _chain(x, 4)
        gated.gate.set()
    assert torch.equal(torch.autograd.grad(loss, x)[0], expected)


# --------------------------------------------------------------------------------- 3. several devices


@pytest.mark.parametrize("storage", ["host", "disk"])
def test_a_backend_for_a_second_device_pins_and_copies_under_its_device(storage, disk_dir):
    sim = SimulatedCuda("random", seed=3)
    backend = CudaBackend(torch.device("cuda", 1), runtime=sim)  # the sim's device memory stands for cuda:1
    with sim.compute():
        x = torch.randn(ROWS, WIDTH, requires_grad=True)
        with sim.unchecked():
            expected = torch.autograd.grad(_chain(x, 6), x)[0]
        for prefetch in (0, 2):
            with offload(storage, prefetch, disk_dir, min_bytes=0, backend=backend):
                loss = _chain(x, 6)
            assert torch.equal(torch.autograd.grad(loss, x)[0], expected)
            del loss
        assert_no_violations(sim)  # no worker or release thread touched CUDA without a device guard
    backend.close()
    assert sim.pinned_on and set(sim.pinned_on) == {1}, sim.pinned_on


class _FakeCudart:
    def __init__(self, error: int = 0) -> None:
        self.error, self.calls = error, []

    def cudaHostRegister(self, pointer, nbytes, flags):
        self.calls.append(("register", nbytes, flags))
        return self.error

    def cudaHostUnregister(self, pointer):
        self.calls.append(("unregister", pointer))
        return 0


def test_pinned_memory_is_registered_portable_and_unregistered():
    cudart = _FakeCudart()
    runtime = TorchCudaRuntime(cudart=cudart)
    tensor = runtime.pin(8192)
    assert tensor.numel() == 8192 and tensor.data_ptr() % 4096 == 0
    runtime.unpin(tensor)
    assert cudart.calls == [("register", 8192, HOST_REGISTER_PORTABLE), ("unregister", tensor.data_ptr())]


def test_a_failed_registration_clears_the_cuda_error_and_names_the_fix():
    cleared = []
    runtime = TorchCudaRuntime(cudart=_FakeCudart(error=2), clear_error=lambda: cleared.append(True))
    with pytest.raises(RuntimeError, match=r"page-locking 4096 bytes .*cudaError 2.*free host memory"):
        runtime.pin(4096)
    assert cleared == [True]  # else the next unrelated CUDA call would report this error


# ---------------------------------------------------------------------------- 4. pinned memory unpinned


@pytest.mark.parametrize("storage", ["host", "disk"])
def test_pinned_memory_is_unregistered_on_close_and_on_collection(storage, disk_dir):
    for close in (True, False):
        sim = SimulatedCuda("lazy")
        backend = CudaBackend(torch.device("cpu"), runtime=sim)
        with sim.compute():
            x = torch.randn(ROWS, WIDTH, requires_grad=True)
            with offload(storage, 1, disk_dir, min_bytes=0, backend=backend):
                loss = _chain(x, 4)
            torch.autograd.grad(loss, x)
            del loss
            _settled(sim)
            assert sim.pinned_bytes > 0
            if close:
                backend.close()
            else:
                backend._io.shutdown()  # the workers hold the backend; a dropped backend has none running
                del backend
                gc.collect()
            assert sim.pinned_bytes == 0, (close, sim.pinned_bytes)
            assert not sim.violations


def test_close_on_another_thread_unpins_under_the_device_and_keeps_a_reload_in_use_safe():
    sim = SimulatedCuda("lazy")
    backend = CudaBackend(torch.device("cpu"), runtime=sim)
    tier = HostTier()
    data = torch.randn(4096).view(torch.uint8)
    with sim.compute():
        out = backend.copy_out(data, tier, backend.saved(data))
        backend.wait(out)
        reloaded = backend.wait(backend.copy_in(out, tier))  # still used by "backward" when the backend closes
        used = reloaded.view(torch.float32) * 2
        closer = threading.Thread(target=backend.close, name="closer")
        closer.start()
        closer.join()
        assert sim.pinned_bytes == 0
        del reloaded, out
        _settled(sim)
    assert not sim.violations, sim.violations
    assert torch.equal(used, data.view(torch.float32) * 2)


@pytest.mark.parametrize("storage", ["host", "disk"])
def test_close_waits_for_queued_copies_before_unpinning(storage, disk_dir):
    from acshim.storage.disk import DiskTier
    from acshim.storage.native import file_io

    sim = SimulatedCuda("lazy")
    backend = CudaBackend(torch.device("cpu"), runtime=sim)
    tier = HostTier() if storage == "host" else DiskTier(file_io(False), disk_dir)
    data = torch.randn(4096).view(torch.uint8)
    with sim.compute():
        out = backend.copy_out(data, tier, backend.saved(data))  # queued on the D2H stream, never waited
        if storage == "disk":
            backend.wait(out)
            reload = backend.copy_in(out, tier)
            backend.wait(reload)
        backend.close()
        assert sim.pinned_bytes == 0
    assert not sim.violations, sim.violations


# ----------------------------------------------------------------------------------- 5. graph capture


def test_saving_under_graph_capture_raises_naming_the_fix(sim_cuda):
    sim, backend = sim_cuda
    x = torch.randn(ROWS, WIDTH, requires_grad=True)
    with pytest.raises(RuntimeError, match="CUDA graph capture.*no_offload"), sim.capture():
        with offload("host", 0, min_bytes=0, backend=backend):
            _chain(x, 3)


def test_a_backward_under_graph_capture_raises_naming_the_fix(sim_cuda):
    sim, backend = sim_cuda
    x = torch.randn(ROWS, WIDTH, requires_grad=True)
    with offload("host", 0, min_bytes=0, backend=backend):
        loss = _chain(x, 3)
    with pytest.raises(RuntimeError, match="CUDA graph capture.*no_offload"), sim.capture():
        torch.autograd.grad(loss, x)


def test_the_simulator_forbids_host_waits_and_pinning_under_capture():
    sim = SimulatedCuda("lazy")
    event = sim.Event()
    event.record(sim.default_stream)
    with sim.capture():
        assert sim.is_capturing()
        for call in (event.synchronize, event.query, sim.default_stream.synchronize, lambda: sim.pin(4096)):
            with pytest.raises(RuntimeError, match="not permitted when stream is capturing"):
                call()
    assert not sim.is_capturing()
    event.synchronize()


# ----------------------------------------------------------------------------------- 6. smaller paths


def test_a_kept_tensor_after_a_failed_write_is_tied_to_the_stream_backward_uses(sim_cuda, disk_dir):
    from .test_simulated_cuda import _GatedIO

    sim, backend = sim_cuda
    torch.manual_seed(0)
    a = nn.Linear(WIDTH, WIDTH)
    x = torch.randn(ROWS, WIDTH)
    side = sim.Stream()

    def forward():
        side.wait_stream(sim.current_stream())
        with sim.stream(side):
            h = a(x).tanh()  # made (and its copy out issued) on the side stream: the kept copy's "home"
        current = sim.current_stream()
        current.wait_stream(side)
        sim.record_stream(h, current)
        return (h * h).exp().sum()

    with sim.unchecked():
        expected = torch.autograd.grad(forward(), list(a.parameters()))
    scope = offload("disk", 0, disk_dir, min_bytes=0, backend=backend)
    gated = scope._tier.io = _GatedIO(scope._tier.io, fail_writes=errno.ENOSPC)
    gated.gate.clear()
    with pytest.raises(OffloadIOError), scope:
        loss = forward()
        gated.gate.set()
    got = torch.autograd.grad(loss, list(a.parameters()))  # backward reads the kept copies on this stream
    for g, e in zip(got, expected):
        sim.record_stream(g, sim.current_stream())  # made on the side stream (its backward's), used here
        assert torch.equal(g, e)
    del loss
    _settled(sim)  # the fixture then fails on memory freed while this stream may still use it


def test_a_backend_override_leaves_host_memory_alone(sim_cuda):
    sim, backend = sim_cuda
    w = torch.randn(WIDTH, WIDTH, requires_grad=True)
    host = sim.pageable(torch.randn(ROWS, WIDTH))  # a CPU tensor of 64 KiB, not the backend's device memory
    with sim.unchecked():
        expected = torch.autograd.grad((host @ w).sin().sum(), w)[0]
    with offload("host", 0, min_bytes=0, backend=backend) as scope:
        loss = (host @ w).sin().sum()  # saves ``host`` (a CPU tensor) and the device product
    assert torch.equal(torch.autograd.grad(loss, w)[0], expected)
    assert scope.stats.kept >= 1 and scope.stats.moved >= 1, scope.stats


def test_the_simulator_refuses_record_stream_on_host_memory_and_makes_pageable_copies_synchronous():
    sim = SimulatedCuda("lazy")
    host = sim.pageable(torch.randn(1024))
    with pytest.raises(RuntimeError, match="expected a CUDA tensor"):
        sim.record_stream(host, sim.default_stream)
    with pytest.raises(RuntimeError, match="expected a CUDA tensor"):
        sim.record_stream(sim.pin(4096), sim.default_stream)
    side = sim.Stream()
    device = sim.empty(4096)
    pinned = sim.pin(4096)
    with sim.stream(side):
        sim.copy(pinned, device)  # pinned: asynchronous, nothing waits
    assert sim.synchronized_by == {}
    with sim.stream(side):
        sim.copy(host.view(torch.uint8), device)  # pageable: the host waits for the copy
    assert sum(sim.synchronized_by.values()) == 1
    sim.drain()


def test_a_prefetched_copy_never_waited_for_is_not_overwritten_by_a_reused_region(sim_cuda):
    sim, backend = sim_cuda
    tier = HostTier()
    first = torch.randn(4096).view(torch.uint8)
    out = backend.copy_out(first, tier, backend.saved(first))
    backend.wait(out)
    region = out.slot.offset, out.slot.slab
    incoming = backend.copy_in(out, tier)  # prefetched; backward stops before it (a partial backward)
    backend.release(out, tier)  # the graph is dropped: the region goes back to the pool
    second = torch.randn(4096).view(torch.uint8)
    again = backend.copy_out(second, tier, backend.saved(second))
    assert (again.slot.offset, again.slot.slab) == region  # the same region, written again
    sim.drain()
    with sim.unchecked():
        assert torch.equal(incoming.result, first)  # the reload read the first bytes, not the second's
    backend.wait(again)
    backend.release(again, tier)


def test_the_simulator_reports_a_copy_that_overwrites_bytes_another_stream_may_still_read():
    sim = SimulatedCuda("lazy")
    s1, s2 = sim.Stream(), sim.Stream()
    pinned, a, b = sim.pin(4096), sim.empty(4096), sim.empty(4096)
    with sim.stream(s1):
        sim.copy(pinned, a)
    ready = sim.Event()
    ready.record(s1)
    s2.wait_event(ready)
    with sim.stream(s2):
        sim.copy(b, pinned)  # reads the pinned bytes
    with sim.stream(s1):
        sim.copy(pinned, a)  # s1 never waited for s2's read
    assert [v.kind for v in sim.violations] == ["overwritten while read"]
    sim.drain()


def test_the_simulated_allocator_reuses_a_block_only_after_its_recorded_stream_is_seen_done():
    sim = SimulatedCuda("lazy")
    side = sim.Stream()
    with sim.stream(side):
        block = sim.empty(GROUP_BYTES)
    sim.record_stream(block, sim.default_stream)
    with sim.compute():
        block.add_(0)  # a use on the default stream
    del block
    with sim.stream(side):
        second = sim.empty(GROUP_BYTES)  # the host has not seen that use finish: a new block
    assert sim.reserved_bytes == 2 * GROUP_BYTES
    sim.default_stream.synchronize()
    with sim.stream(side):
        third = sim.empty(GROUP_BYTES)  # now it has: the first block again
    assert sim.reserved_bytes == 2 * GROUP_BYTES and sim.allocated_bytes == 2 * GROUP_BYTES
    del third  # freed with no use elsewhere: its stream's pool takes it at once
    with sim.stream(side):
        fourth = sim.empty(GROUP_BYTES)
    assert sim.reserved_bytes == 2 * GROUP_BYTES
    with sim.stream(sim.Stream()):
        sim.empty(GROUP_BYTES)  # another stream's pool: a block of its own
    assert sim.reserved_bytes == 3 * GROUP_BYTES
    del second, fourth


# ---------------------------------------- autograd nodes run on their forward op's stream (item 1)


def test_a_reload_is_ordered_before_its_use_by_a_backward_node_on_a_side_stream(sim_cuda):
    """torch runs a node's backward on the stream its forward op ran on: a tensor saved by an op on a
    side stream is unpacked, and read, on that side stream, so the tier must order its reload before
    that stream (the stream current at unpack), not before the stream backward was called on."""
    sim, backend = sim_cuda
    torch.manual_seed(0)
    a = nn.Linear(WIDTH, WIDTH)
    x = torch.randn(ROWS, WIDTH)
    side = sim.Stream()

    def forward():
        side.wait_stream(sim.current_stream())
        with sim.stream(side):
            h = a(x).sin().sin().sin()  # three saved tensors, their backward nodes on the side stream
        current = sim.current_stream()
        current.wait_stream(side)
        sim.record_stream(h, current)
        return (h * 2).sum()

    with sim.unchecked():
        expected = torch.autograd.grad(forward(), list(a.parameters()))
    unpacked_on = []
    wait = backend.wait

    def recording_wait(ticket):
        if ticket.source is not None:  # a copy in, waited for at unpack
            unpacked_on.append(sim.current_stream())
        return wait(ticket)

    backend.wait = recording_wait
    with offload("host", 0, min_bytes=0, backend=backend) as scope:
        loss = forward()
    got = torch.autograd.grad(loss, list(a.parameters()))
    for g, e in zip(got, expected):
        sim.record_stream(g, sim.current_stream())  # made on the side stream, used here
        assert torch.equal(g, e)
    assert scope.stats.fetched >= 3 and unpacked_on and all(s is side for s in unpacked_on), unpacked_on
    del loss
    _settled(sim)
