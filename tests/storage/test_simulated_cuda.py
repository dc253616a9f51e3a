"""The CUDA backend proved on a CPU (issue 19): the real ``CudaBackend`` over the simulated CUDA runtime
(``acshim.backends.simcuda``: streams as queues of deferred copies, a happens-before checker that
poisons out-of-order reads, the caching allocator's ``record_stream`` rule). One test per finding of
the issue; each fails on the backend before it. Every test here uses that simulator (lazy and random
execution orders); overlap *timing* is measured with the latency-only ``SimulatedBackend``
(test_prefetch.py), which models no streams.

The exactness, in-place and partition tests run on the simulator too (their ``runtime`` fixture);
``tests/tools/mutate_cuda.py`` deletes each wait, ``record_stream`` and host synchronisation of
``backends/cuda.py`` in turn and checks that these tests turn red."""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest
import torch
from torch import nn

import acshim
from acshim.backends.cuda import STAGING_SLAB_BYTES, CudaBackend
from acshim.backends.simcuda import SimulatedCuda
from acshim.storage import OffloadIOError, boundary_offload, offload
from acshim.storage.host import HostTier
from acshim.storage.offload_session import OffloadSession
from acshim.testing import seeded, tiny_sequential

from .conftest import assert_no_violations, simulated_cuda

ORDERS = ["lazy", "random"]
MB = 1 << 20


@pytest.fixture(params=ORDERS)
def sim_cuda(request):
    sim, backend = simulated_cuda(request.param, seed=7)
    with sim.compute():
        yield sim, backend
    assert_no_violations(sim)
    backend.close()


@pytest.fixture
def lazy_cuda():
    sim, backend = simulated_cuda("lazy")
    with sim.compute():
        yield sim, backend
    assert_no_violations(sim)
    backend.close()


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def _step(model: nn.Module, x: torch.Tensor, scope=None) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # dropout masks repeat
    if scope is None:
        loss = model(x).sum()
    else:
        with scope:
            loss = model(x).sum()
    loss.backward()
    return _grads(model)


def _assert_equal(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


class _GatedIO:
    """An I/O engine whose writes wait for ``gate`` (a slow disk) and may fail with ``errno``."""

    def __init__(self, inner, fail_writes: int | None = None, fail_reads: int | None = None) -> None:
        self.inner, self.fail_writes, self.fail_reads = inner, fail_writes, fail_reads
        self.gate = threading.Event()
        self.gate.set()

    def write(self, fd, data, offset, direct):
        assert self.gate.wait(60), "the gate never opened"
        if self.fail_writes is not None:
            raise OSError(self.fail_writes, os.strerror(self.fail_writes))
        return self.inner.write(fd, data, offset, direct)

    def read(self, fd, out, offset, direct):
        if self.fail_reads is not None:
            raise OSError(self.fail_reads, os.strerror(self.fail_reads))
        return self.inner.read(fd, out, offset, direct)


# ----------------------------------------------------------------------------- 1. the pinned pool


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("storage", ["host", "disk"])
def test_pinned_memory_is_pinned_in_the_first_step_only_and_fits_what_the_tier_holds(sim_cuda, storage, prefetch,
                                                                                   disk_dir):
    sim, backend = sim_cuda
    model, x = seeded(lambda: tiny_sequential(4, 64)), torch.randn(32, 64)
    expected = _step(model, x)
    pinned_after = []
    for _ in range(4):
        _assert_equal(_step(model, x, offload(storage, prefetch, disk_dir, min_bytes=0, backend=backend)), expected)
        pinned_after.append((sim.pinned_allocations, sim.pinned_bytes))
    assert pinned_after[0][0] > 0
    assert pinned_after[1:] == pinned_after[:1] * 3, pinned_after  # nothing pinned after the first step
    pool = backend.host_pool.stats if storage == "host" else backend.staging.stats
    if storage == "host":  # the pool is the tier: pinned <= 1.1x the bytes it held at its peak
        assert pool.pinned_bytes <= 1.1 * pool.peak_requested_bytes, pool
    else:  # staging only, one slab; reads use it too (no per-read allocation of padded size + a page)
        assert backend.host_pool.stats.allocations == 0
        assert pool.allocations == 1 and pool.pinned_bytes == STAGING_SLAB_BYTES, pool
    assert sim.pinned_bytes == backend.host_pool.stats.pinned_bytes + backend.staging.stats.pinned_bytes


def test_pool_regions_coalesce_and_align(lazy_cuda):
    sim, _ = lazy_cuda
    from acshim.backends.pinned import PinnedPool

    pool = PinnedPool(sim.pin, alignment=4096, settle=None)
    regions = [pool.take(n) for n in (5000, 4096, 1, 9000)]
    assert all(r.tensor.data_ptr() % 4096 == 0 for r in regions)
    for region in regions:
        pool.give(region)
    assert pool.stats.in_use_bytes == 0 and pool.stats.allocations == 4
    again = [pool.take(n) for n in (5000, 4096, 1, 9000)]  # the same requests: the same slabs, nothing new
    assert pool.stats.allocations == 4 and [r.slab for r in again] == [r.slab for r in regions]


# ------------------------------------------------------------------ 2. two streams, ordered by events


def test_a_reload_does_not_wait_for_copies_out_issued_after_its_own(lazy_cuda):
    sim, backend = lazy_cuda
    tier = HostTier()
    first = torch.randn(4096).view(torch.uint8)
    out = backend.copy_out(first, tier, backend.saved(first))
    backend.wait(out)  # landed
    later_data = [torch.randn(4096).view(torch.uint8) for _ in range(4)]
    later = [backend.copy_out(d, tier, backend.saved(d)) for d in later_data]  # pending on the D2H stream
    back = backend.wait(backend.copy_in(out, tier))
    assert torch.equal(back.clone(), first)  # compute reads it: the reload ran
    assert not any(backend.done(ticket) for ticket in later)  # ... without the copies out queued after it
    for ticket in later:
        backend.wait(ticket)
    for ticket in (out, *later):
        backend.release(ticket, tier)


# ------------------------------------------------- 3. the disk tier pipelined, back-pressure that holds


def _big_chain(x: torch.Tensor, depth: int = 4) -> torch.Tensor:
    for _ in range(depth):
        x = x.exp() * 0.5  # exp saves its 4 MiB output
    return x.sum()


def test_disk_tier_forward_never_waits_for_a_file_write_while_staging_has_room(sim_cuda, disk_dir):
    sim, backend = sim_cuda
    x = (torch.randn(1024, 1024) * 0.01).requires_grad_()  # 4 MiB per saved tensor, 16 MiB in all
    expected = torch.autograd.grad(_big_chain(x), x)[0]
    scope = offload("disk", 0, disk_dir, min_bytes=0, backend=backend)
    gated = scope._tier.io = _GatedIO(scope._tier.io)
    gated.gate.clear()  # the disk takes forever
    opened_by_timer = threading.Event()

    def open_late() -> None:
        opened_by_timer.set()
        gated.gate.set()

    timer = threading.Timer(10.0, open_late)
    timer.start()
    try:
        with scope:
            loss = _big_chain(x)
            forward_done_in_time = not opened_by_timer.is_set()  # (the scope's exit waits for the writes)
            gated.gate.set()
    finally:
        timer.cancel()
    assert forward_done_in_time, "forward waited for a file write (more than 8 MiB in flight)"
    assert sim.synchronized_by.get(threading.current_thread().name, 0) == 0  # no sync on the forward thread
    assert torch.equal(torch.autograd.grad(loss, x)[0], expected)


def test_disk_tier_staging_bounds_what_waits_for_the_disk(lazy_cuda, disk_dir):
    sim, _ = lazy_cuda
    backend = CudaBackend(torch.device("cpu"), runtime=sim, staging_bytes=8 * MB)
    x = (torch.randn(1024, 1024) * 0.01).requires_grad_()
    expected = torch.autograd.grad(_big_chain(x, 6), x)[0]
    scope = offload("disk", 0, disk_dir, min_bytes=0, backend=backend)
    gated = scope._tier.io = _GatedIO(scope._tier.io)
    gated.gate.clear()
    threading.Timer(1.0, gated.gate.set).start()  # forward must wait for it: staging holds 2 of 6
    start = time.monotonic()
    with scope:
        loss = _big_chain(x, 6)
    assert time.monotonic() - start >= 0.9
    assert backend.staging.stats.peak_in_use_bytes <= 8 * MB, backend.staging.stats
    assert torch.equal(torch.autograd.grad(loss, x)[0], expected)
    backend.close()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_host_tier_in_flight_limit_holds_back_forward(sim_cuda, prefetch, monkeypatch):
    from acshim.storage import offload_session as session_module

    sim, backend = sim_cuda
    model, x = seeded(lambda: tiny_sequential(6, 128)), torch.randn(256, 128)  # 128 KiB per block input
    expected = _step(model, x)
    limit = 1 * MB
    monkeypatch.setattr(session_module, "DEFAULT_BYTES_IN_FLIGHT", limit)
    scope = offload("host", prefetch, min_bytes=0, backend=backend)
    _assert_equal(_step(model, x, scope), expected)
    largest = 256 * 512 * 4  # an fc1 output
    assert scope.stats.moved_bytes > 4 * limit
    assert sim.peak_pending_out_bytes <= limit + largest, sim.peak_pending_out_bytes


# ----------------------------------------------- 4. a deferred copy out waits for the producing stream


@pytest.mark.parametrize("storage", ["host", "disk"])
def test_deferred_copy_out_waits_for_the_stream_that_made_the_tensor(sim_cuda, storage, disk_dir):
    sim, backend = sim_cuda
    torch.manual_seed(0)
    a, b = nn.Linear(64, 64), nn.Linear(64, 64)
    x = torch.randn(32, 64)

    def forward(s1, s2):
        s1.wait_stream(sim.current_stream())  # the user orders their streams after x is made
        s2.wait_stream(sim.current_stream())
        with sim.stream(s1):
            h = a(x).tanh()  # saved on s1
        with sim.stream(s2):
            g = b(x).tanh()  # saved on s2: the deferred copies of h are issued here, s2 never waited on s1
            g = g.exp().sin()
        current = sim.current_stream()
        current.wait_stream(s1)
        current.wait_stream(s2)
        sim.record_stream(h, current)  # used on this stream now (the allocator's rule, as on a GPU)
        sim.record_stream(g, current)
        # more saves after: everything saved on s1 and s2 leaves (backward reads only copies back)
        return (h * g).exp().tanh().sin().sum()

    s1, s2 = sim.Stream(), sim.Stream()
    with sim.unchecked():  # the reference: plain CPU ops
        expected = torch.autograd.grad(forward(s1, s2), [*a.parameters(), *b.parameters()])
    with offload(storage, 2, disk_dir, min_bytes=0, backend=backend):
        loss = forward(s1, s2)
    got = torch.autograd.grad(loss, [*a.parameters(), *b.parameters()])  # a's and b's on s1 and s2
    for grad in got:
        sim.record_stream(grad, sim.current_stream())  # made on a side stream, used here
    _assert_equal(list(got), list(expected))


# ------------------------------------------------------------------------------------- 5. errors


def test_a_failed_disk_write_keeps_the_tensor_in_device_memory(sim_cuda, disk_dir, monkeypatch):
    sim, backend = sim_cuda
    model, x = seeded(lambda: tiny_sequential(3, 64)), torch.randn(32, 64)
    expected = _step(model, x)
    scope = offload("disk", 0, disk_dir, min_bytes=0, backend=backend)
    gated = scope._tier.io = _GatedIO(scope._tier.io, fail_writes=errno.ENOSPC)
    gated.gate.clear()  # the disk fills up once forward has saved everything
    unpacked = []
    original = OffloadSession.unpack

    def unpack(self, packed):
        tensor = original(self, packed)
        if type(packed) is not tuple:  # a moved tensor (its write failed: kept)
            unpacked.append(tensor)
        return tensor

    monkeypatch.setattr(OffloadSession, "unpack", unpack)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    with pytest.raises(OffloadIOError) as raised, scope:
        loss = model(x).sum()
        gated.gate.set()
    assert raised.value.errno == errno.ENOSPC and "kept in memory" in str(raised.value)
    loss.backward()
    _assert_equal(_grads(model), expected)
    assert unpacked and all(sim.is_device_memory(t) for t in unpacked), "a kept tensor is in pinned host memory"


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_failed_read_is_always_an_offload_io_error(sim_cuda, disk_dir, prefetch):
    sim, backend = sim_cuda
    model, x = seeded(lambda: tiny_sequential(3, 64)), torch.randn(32, 64)
    scope = offload("disk", prefetch, disk_dir, min_bytes=0, backend=backend)
    scope._tier.io = _GatedIO(scope._tier.io, fail_reads=errno.EIO)
    with scope:
        loss = model(x).sum()
    with pytest.raises(OffloadIOError, match="reading back a saved tensor") as raised:
        loss.backward()
    assert raised.value.errno == errno.EIO


def test_done_never_raises_for_a_failed_copy(lazy_cuda, disk_dir):
    from acshim.storage.disk import DiskTier
    from acshim.storage.native import file_io

    sim, backend = lazy_cuda
    tier = DiskTier(_GatedIO(file_io(False), fail_reads=errno.EIO), disk_dir)
    data = torch.randn(2048).view(torch.uint8)
    out = backend.copy_out(data, tier, backend.saved(data))
    backend.wait(out)
    incoming = backend.copy_in(out, tier)
    incoming.pending.exception(timeout=30)  # the read has failed on its worker
    assert backend.done(incoming) is True  # finished (not raising): wait() raises its error
    with pytest.raises(OSError):
        backend.wait(incoming)
    backend.release(out, tier)


@pytest.mark.parametrize("storage", ["host", "disk"])
def test_a_cuda_error_while_waiting_does_not_replace_the_forwards_own_error(sim_cuda, storage, disk_dir):
    sim, backend = sim_cuda
    model, x = seeded(lambda: tiny_sequential(3, 64)), torch.randn(32, 64)
    hold = threading.Event()
    for _ in range(2):  # hold the disk tier's workers: their synchronisations come after the error
        backend._io.submit(hold.wait, 60)
    try:
        with pytest.raises(ValueError, match="the model failed") as raised:
            with offload(storage, 0, disk_dir, min_bytes=0, backend=backend):
                model(x).sum()
                sim.fail_synchronize = RuntimeError("CUDA error: an illegal memory access was encountered")
                hold.set()
                raise ValueError("the model failed")
    finally:
        hold.set()
        sim.fail_synchronize = None
    notes = getattr(raised.value, "__notes__", [])
    if storage == "disk":
        assert any("CUDA error" in note for note in notes), raised.value
    else:  # the host tier's copies out cannot fail: forward's end waits for none (issue 27); a finished one
        assert all("CUDA error" in note for note in notes), notes  # collected on the way may report it


# ----------------------------------------------------------- prefetch and the partitioned path, on it


@pytest.mark.parametrize("storage", ["host", "disk"])
@pytest.mark.parametrize("prefetch", [0, 1, 2, 3])
def test_boundary_prefetch_window_and_exactness(sim_cuda, storage, prefetch, disk_dir):
    sim, backend = sim_cuda
    model, x = seeded(lambda: tiny_sequential(6, 64)), torch.randn(32, 64)
    expected = _step(model, x)
    scope = boundary_offload(storage, prefetch, disk_dir, min_bytes=0, backend=backend)
    acshim.apply_checkpointing(model, saved_tensors_scope=scope)
    for _ in range(2):
        _assert_equal(_step(model, x), expected)
    fetches = list(scope.session.scheduler.fetches)
    assert fetches and all(0 <= f.at_group - f.group <= prefetch for f in fetches)
    assert scope.stats.sent_out == 2 * (6 - prefetch)


def test_partitioned_inputs_on_the_host_tier(runtime):
    from acshim.facades import deepspeed
    from acshim.facades.deepspeed.runtime.activation_checkpointing._state import STATE
    from acshim.storage import recording

    ckpt = deepspeed.checkpointing
    STATE.reset()
    try:
        for checkpoint in (ckpt.checkpoint, ckpt.non_reentrant_checkpoint):
            model = seeded(lambda: nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.3), nn.Tanh())
                                                   for _ in range(3))))
            x = torch.randn(32, 64)
            expected = _step(model, x)
            with recording() as sessions:
                ckpt.configure(None, partition_activations=True, checkpoint_in_cpu=True)
                model.zero_grad(set_to_none=True)
                torch.manual_seed(1)
                hidden = x * 1.0
                for block in model:
                    hidden = checkpoint(block, hidden)
                hidden.sum().backward()
            _assert_equal(_grads(model), expected)
            (session,) = sessions
            assert session.stats.saved == 3
            assert session.stats.moved == (3 if runtime.host_moves else 0)
            STATE.reset()
    finally:
        STATE.reset()


# ------------------------------------------------------------------------------ the simulator itself


def test_the_simulator_poisons_a_read_that_is_not_ordered_after_its_write():
    sim = SimulatedCuda("lazy")
    side = sim.Stream()
    with sim.compute():
        source = torch.randn(256)
        target = sim.empty(1024)
        with sim.stream(side):  # the side stream never waited for the compute that made source
            sim.copy(target, source.view(torch.uint8))
        assert sim.violations and sim.violations[0].kind == "read before written"
        read = target.view(torch.float32).clone()  # and compute never waited for the copy
    assert torch.isnan(read).all()
    assert len(sim.violations) == 2


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_an_exception_unwinding_backward_gives_the_graphs_pinned_regions_back_at_once(sim_cuda, prefetch):
    """Issue 28.2 on the CUDA path: the host tier's pinned regions of a graph whose backward an
    exception stopped go back to the pool while the script still holds the graph."""
    sim, backend = sim_cuda
    model, x = seeded(lambda: tiny_sequential(4, 64)), torch.randn(32, 64)
    with offload("host", prefetch, min_bytes=0, backend=backend):
        h = x
        for index, layer in enumerate(model):
            h = layer(h)
            if index == len(model) // 2:
                h.register_hook(lambda grad: (_ for _ in ()).throw(KeyboardInterrupt()))
        loss = h.square().mean()
    assert backend.host_pool.stats.in_use_bytes > 0
    with pytest.raises(KeyboardInterrupt):
        loss.backward()
    acshim.storage.reaper.REAPER.settle()
    assert backend.host_pool.stats.in_use_bytes == 0
    with pytest.raises(RuntimeError, match="Trying to backward through the graph a second time"):
        loss.backward()
