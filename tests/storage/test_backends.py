"""The transfer backends behind one interface: copy out, copy in, done, wait, release. The CPU
backend and the latency-only ``SimulatedBackend`` here; the CUDA backend runs on the simulated CUDA
runtime in test_simulated_cuda.py (and on a real GPU in test_cuda.py, ``pytest -m cuda``)."""

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


NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine (GPU: pytest -m cuda)")


@NO_GPU
def test_cuda_backend_is_importable_and_refuses_to_run_without_cuda():
    from acshim.backends.cuda import CudaBackend

    assert issubclass(CudaBackend, Backend) and not torch.cuda.is_available()
    with pytest.raises((AssertionError, RuntimeError)):  # torch: "Torch not compiled with CUDA enabled"
        CudaBackend(torch.device("cuda", 0))


def test_the_cpu_only_checks_skip_on_a_gpu_machine(tmp_path):
    """tests/storage/test_backends.py and test_native.py run on a machine with a GPU: the checks of
    the CPU-only machine skip there instead of failing (torch.cuda.is_available() made True)."""
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    script = tmp_path / "gpu_machine.py"
    script.write_text(
        "import sys, pytest, torch\n"
        "torch.cuda.is_available = lambda: True\n"
        "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-p', 'no:xdist', "
        f"{str(here / 'test_backends.py')!r}, {str(here / 'test_native.py')!r}, "
        "'-k', 'not skip_on_a_gpu_machine']))\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                          cwd=here.parent.parent)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "2 skipped" in done.stdout, done.stdout[-2000:]
