"""The transfer backends behind one interface: copy out, copy in, done, wait, release."""

from __future__ import annotations

import pytest
import torch

from acshim.backends import Backend, CpuBackend, SimulatedBackend, backend_for
from acshim.storage.disk import DiskTier
from acshim.storage.host import HostTier
from acshim.storage.native import file_io


def test_cpu_backend_round_trips_through_disk_and_release_frees_the_space(disk_dir):
    backend, tier = CpuBackend(), DiskTier(file_io(), disk_dir)
    data = torch.randint(0, 256, (10_000,), dtype=torch.uint8)
    stored = backend.copy_out(data, tier)
    back = backend.wait(backend.copy_in(stored, tier))
    assert torch.equal(back, data)
    assert tier._current.live == 1
    backend.release(stored, tier)
    backend.wait(stored)
    assert tier._current.live == 0 and tier._current.end == 0
    backend.close()


def test_cpu_backend_holds_no_reference_to_the_bytes_once_their_write_is_waited_for(disk_dir):
    """What forward holds after its copies out are waited for must not depend on thread timing."""
    import weakref

    backend, tier = CpuBackend(), DiskTier(file_io(), disk_dir)
    for _ in range(50):
        data = torch.randint(0, 256, (100_000,), dtype=torch.uint8)
        alive = weakref.ref(data)
        stored = backend.copy_out(data, tier)
        del data
        backend.wait(stored)
        assert alive() is None
        backend.release(stored, tier)
    backend.close()


def test_simulated_backend_lands_copies_at_per_byte_deadlines():
    backend, tier = SimulatedBackend(seconds_per_byte=1e-6), HostTier()
    data = torch.zeros(5_000, dtype=torch.uint8)  # 5 ms on the simulated link
    stored = backend.copy_out(data, tier)
    incoming = backend.copy_in(stored, tier)  # queued behind the copy out
    assert not backend.done(incoming)
    assert backend.wait(incoming) is data and backend.done(incoming)
    out, back = backend.log
    assert out.end - out.start == pytest.approx(5e-3) and back.start >= out.end
    assert backend.transfer_seconds("in") == pytest.approx(5e-3)


def test_backend_is_picked_by_device_and_unknown_devices_are_refused():
    assert isinstance(backend_for(torch.device("cpu")), CpuBackend)
    assert backend_for("cpu") is backend_for(torch.device("cpu"))  # one per device
    with pytest.raises(NotImplementedError, match="no transfer backend for 'meta'.*no_offload"):
        backend_for(torch.device("meta"))


def test_cuda_backend_is_importable_and_refuses_to_run_without_cuda():
    from acshim.backends.cuda import CudaBackend

    assert issubclass(CudaBackend, Backend) and not torch.cuda.is_available()
    with pytest.raises((AssertionError, RuntimeError)):  # torch: "Torch not compiled with CUDA enabled"
        CudaBackend(torch.device("cuda", 0))
