"""Prefetch, measured with the latency-only ``SimulatedBackend`` (copies finish at per-byte deadlines;
it models no streams): H >= 1 hides the transfer time H = 0 exposes; order and horizon are
respected; nothing is late. Every test here uses that backend; stream ordering of the real CUDA
backend is checked by the simulated CUDA runtime (test_simulated_cuda.py), not here."""

from __future__ import annotations

import time

import pytest
import torch

import acshim
from acshim.backends import SimulatedBackend
from acshim.storage import boundary_offload, offload
from acshim.testing import MLPBlock

REGIONS = 8
WIDTH = 64
ROWS = 128
SECONDS_PER_BYTE = 6e-8  # a region's boundary input is 32 KiB: ~2 ms per simulated transfer
REGION_SECONDS = 0.006  # each region's forward (and so its recompute) takes at least this long


class _TimedBlock(torch.nn.Module):
    """An MLP block whose forward takes at least ``REGION_SECONDS``: a floor on compute per region
    that does not depend on how loaded the machine is (sleeping uses no CPU, like a GPU kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLPBlock(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(REGION_SECONDS)
        return self.mlp(x)


def _backward_with(prefetch: int, seconds_per_byte: float = SECONDS_PER_BYTE
                   ) -> tuple[acshim.storage.BoundaryOffload, SimulatedBackend]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_TimedBlock() for _ in range(REGIONS)])
    backend = SimulatedBackend(seconds_per_byte)
    scope = boundary_offload("host", prefetch, min_bytes=0, backend=backend)
    acshim.apply_checkpointing(model, saved_tensors_scope=scope)
    model(torch.randn(ROWS, WIDTH)).sum().backward()
    backend.close()
    return scope, backend


def test_prefetch_hides_at_least_90_percent_of_exposed_transfer_time():
    exposed = {h: _backward_with(h)[0].stats.wait_seconds for h in (0, 1, 2)}
    transfer_in = _backward_with(0)[1].transfer_seconds("in")
    assert exposed[0] >= 0.8 * transfer_in  # H = 0: backward waits for (almost) every copy
    for horizon in (1, 2):
        assert exposed[horizon] <= 0.1 * exposed[0], (horizon, exposed)


@pytest.mark.parametrize("prefetch", [1, 2, 3])
def test_no_group_fetched_before_its_turn_plus_horizon_and_none_late(prefetch):
    scope, backend = _backward_with(prefetch)
    fetches = list(scope.session.scheduler.fetches)
    # backward visits groups in decreasing order; a fetch at group g may bring groups g-H .. g only
    assert fetches and all(0 <= f.at_group - f.group <= prefetch for f in fetches)
    fetched = sorted(f.group for f in fetches)
    assert fetched == list(range(REGIONS - prefetch))  # each sent-out group exactly once
    assert scope.stats.sent_out == REGIONS - prefetch  # the last H regions never left
    assert all(record.ready for record in scope.stats.unpacks), (scope.stats.unpacks, backend.log)  # none late
    assert scope.stats.late == 0
    assert [r.direction for r in backend.log].count("in") == REGIONS - prefetch


def test_horizon_zero_fetches_each_group_only_at_its_own_turn():
    # 20x slower transfers (~40 ms): a loaded machine cannot let one finish between its fetch and
    # its unpack, which happen back to back when H = 0
    scope, _ = _backward_with(0, 20 * SECONDS_PER_BYTE)
    assert all(f.at_group == f.group for f in scope.session.scheduler.fetches)
    assert scope.stats.sent_out == REGIONS and scope.stats.late == REGIONS


def test_offload_scope_prefetches_saved_tensors_in_order():
    torch.manual_seed(0)
    x = torch.randn(64, 64, requires_grad=True)
    backend = SimulatedBackend(1e-9)
    with offload("host", 2, min_bytes=0, backend=backend) as scope:
        y = x
        for _ in range(6):
            y = y.exp().tanh()  # exp saves its output, tanh its output: one group each
    y.sum().backward()
    backend.close()
    fetches = list(scope.session.scheduler.fetches)
    assert scope.stats.moved == 12 and scope.stats.sent_out == 10
    assert all(0 <= f.at_group - f.group <= 2 for f in fetches)
    assert sorted(f.group for f in fetches) == list(range(10))


def test_schedule_forgets_graphs_freed_without_backward():
    scope = boundary_offload("host", 1, min_bytes=0, backend=SimulatedBackend(0.0))
    model = torch.nn.Sequential(*[MLPBlock(16) for _ in range(4)])
    acshim.apply_checkpointing(model, saved_tensors_scope=scope)
    for _ in range(80):  # 320 groups of graphs that are dropped, never backwarded
        model(torch.randn(4, 16))
    scheduler = scope.session.scheduler
    assert len(scheduler._stored) <= scheduler.PRUNE_AT + 1 and len(scheduler._resident) <= 1
