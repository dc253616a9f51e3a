"""Fixtures of the storage-tier tests: a private directory for disk files, engine defaults reset, and
``runtime``: the test runs on the CPU backend, or on the real ``CudaBackend`` over the simulated
CUDA runtime (``acshim.backends.simcuda``, lazy and random orders), which then moves every tensor
(the host tier too) and fails the test on any stream-ordering violation."""

from __future__ import annotations

import gc
import os
import zlib
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from acshim.testing import open_descriptors_in


@pytest.fixture
def disk_dir(tmp_path):
    """A directory for the disk tier; the test asserts it is empty afterwards where it matters."""
    path = tmp_path / "offload"
    path.mkdir()
    return str(path)


@pytest.fixture(autouse=True)
def _fresh_defaults():
    from acshim.storage import reset_defaults

    reset_defaults()
    yield
    reset_defaults()


class Offloaded(nn.Module):
    """Runs ``inner``'s forward inside a fresh offload block built by ``make_scope()``; parameter
    names are ``inner``'s own (so step states compare key by key)."""

    def __init__(self, inner: nn.Module, make_scope) -> None:
        super().__init__()
        object.__setattr__(self, "inner", inner)  # not a submodule: keeps parameter names unprefixed
        self.make_scope = make_scope
        self.scopes = []

    def named_parameters(self, *args, **kwargs):
        return self.inner.named_parameters(*args, **kwargs)

    def named_buffers(self, *args, **kwargs):
        return self.inner.named_buffers(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def train(self, mode: bool = True):
        self.inner.train(mode)
        return self

    def forward(self, *args, **kwargs):
        scope = self.make_scope()
        self.scopes.append(scope)
        with scope:
            return self.inner(*args, **kwargs)


@pytest.fixture
def offloaded():
    return Offloaded


private_fds = open_descriptors_in
"""Open descriptors of this process that point into a directory (unlinked files included)."""


@pytest.fixture
def fds_in():
    return private_fds


def spill_bytes(directory: str) -> int:
    """Disk space allocated to this process's open files in ``directory`` (unlinked ones too)."""
    total = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(directory):
                total += os.fstat(int(fd)).st_blocks * 512
        except OSError:
            continue
    return total


@pytest.fixture
def spill_in():
    return spill_bytes


@pytest.fixture
def mlp_input():
    return torch.randn(16, 64, generator=torch.Generator().manual_seed(3))


@dataclass
class Runtime:
    """Which transfer backend a test runs on: ``sim`` is None on the CPU backend."""

    name: str
    sim: object | None = None
    backend: object | None = None

    @property
    def host_moves(self) -> bool:
        """True if the host tier moves these (CPU) tensors: on the simulated GPU it does."""
        return self.sim is not None


def simulated_cuda(order: str, seed: int = 0):
    """A simulated CUDA runtime and the real CUDA backend on it (``device`` is the CPU)."""
    from acshim.backends.cuda import CudaBackend
    from acshim.backends.simcuda import SimulatedCuda

    sim = SimulatedCuda(order, seed=seed)
    return sim, CudaBackend(torch.device("cpu"), runtime=sim)


def assert_no_violations(sim) -> None:
    from acshim.storage.reaper import REAPER

    gc.collect()
    assert REAPER.settle()
    violations = sim.check()
    assert not violations, "\n".join(f"{v.kind}: {v.detail}" for v in violations[:10])


@pytest.fixture(params=["cpu", "simulated-cuda-lazy", "simulated-cuda-random"])
def runtime(request, monkeypatch):
    """Run the test on the CPU backend and on the CUDA backend over the simulated runtime."""
    if request.param == "cpu":
        yield Runtime("cpu")
        return
    from acshim.storage.offload_session import OffloadSession

    sim, backend = simulated_cuda(request.param.rsplit("-", 1)[1], seed=zlib.crc32(request.node.name.encode()))
    monkeypatch.setattr(OffloadSession, "_backend_for",
                        lambda self, tensor: self.backend_override or backend)
    with sim.compute():
        yield Runtime(request.param, sim, backend)
    assert_no_violations(sim)
    backend.close()
