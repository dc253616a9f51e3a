"""The storage tier on a real GPU: ``TORCH_CUDA_SANITIZER=1 pytest -m cuda`` (skipped without a device).

Exactness (offload scope and region boundaries, host and disk tiers, every horizon), prefetch order,
in-place changes after save and a planned model, on ``.cuda()`` models, with deterministic kernels
(so "bitwise equal to no offload" is a fair test on a GPU too) and, when the variable is set, torch's
CUDA sanitizer (CSAN) checking every stream access of the backend. NOT RUN YET: no GPU is available
to this project (docs/gpu.md says so); the same logic is checked on CPU by the simulated CUDA runtime
(test_simulated_cuda.py)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (before CUDA starts)

import acshim
from acshim.storage import boundary_offload, offload
from acshim.testing import hf_inputs, hf_model, seeded, tiny_sequential

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pytest -m cuda on a GPU)")]

HORIZONS = [0, 1, 2]


@pytest.fixture(autouse=True)
def _deterministic():
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(previous)
    torch.cuda.synchronize()


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def _step(model, inputs, scope=None, loss_fn=lambda out: out.sum()) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    if scope is None:
        loss = loss_fn(model(**inputs) if isinstance(inputs, dict) else model(inputs))
    else:
        with scope:
            loss = loss_fn(model(**inputs) if isinstance(inputs, dict) else model(inputs))
    loss.backward()
    return _grads(model)


def _equal(got, expected) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


@pytest.mark.parametrize("prefetch", HORIZONS)
@pytest.mark.parametrize("storage", ["host", "disk"])
def test_offload_scope_is_exact_on_cuda(storage, prefetch, tmp_path):
    model = seeded(lambda: tiny_sequential(4, 256)).cuda()
    x = torch.randn(64, 256, device="cuda")
    expected = _step(model, x)
    for _ in range(3):  # the pinned pools are reused from the second step on
        _equal(_step(model, x, offload(storage, prefetch, str(tmp_path), min_bytes=0)), expected)
    backend = acshim.backends.backend_for(x.device)
    pinned = backend.host_pool.stats.allocations + backend.staging.stats.allocations
    _equal(_step(model, x, offload(storage, prefetch, str(tmp_path), min_bytes=0)), expected)
    assert backend.host_pool.stats.allocations + backend.staging.stats.allocations == pinned


@pytest.mark.parametrize("prefetch", [0, 1, 2, 3])
@pytest.mark.parametrize("reentrant", [False, True])
def test_region_boundaries_prefetched_in_order_on_cuda(reentrant, prefetch, tmp_path):
    model = seeded(lambda: tiny_sequential(6, 256)).cuda()
    x = torch.randn(64, 256, device="cuda")
    expected = _step(model, x)
    scope = boundary_offload("host", prefetch, min_bytes=0)
    acshim.apply_checkpointing(model, saved_tensors_scope=scope, reentrant=reentrant)
    for _ in range(2):
        _equal(_step(model, x), expected)
    fetches = list(scope.session.scheduler.fetches)
    assert all(0 <= f.at_group - f.group <= prefetch for f in fetches)


@pytest.mark.parametrize("storage", ["host", "disk"])
def test_hf_gpt2_offloaded_is_exact_on_cuda(storage, tmp_path):
    model = hf_model("gpt2").cuda()
    inputs = {k: v.cuda() for k, v in dict(hf_inputs("gpt2"), use_cache=False).items() if torch.is_tensor(v)}
    inputs["use_cache"] = False
    expected = _step(model, inputs, loss_fn=lambda out: out.loss)
    _equal(_step(model, inputs, offload(storage, 2, str(tmp_path), min_bytes=0), loss_fn=lambda out: out.loss),
           expected)


@pytest.mark.parametrize("storage", ["host", "disk"])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_in_place_change_after_save_raises_torchs_error_on_cuda(storage, prefetch, tmp_path):
    def run(scope):
        x = torch.randn(32, 32, device="cuda", requires_grad=True)
        with scope:
            h = x * 1
            y = h.sin()
        with torch.no_grad():
            h.mul_(2)
        del h
        try:
            y.sum().backward()
        except RuntimeError as error:
            return str(error)
        return "no error"

    import contextlib

    expected = run(contextlib.nullcontext())
    assert "modified by an inplace operation" in expected
    assert run(offload(storage, prefetch, str(tmp_path), min_bytes=0)) == expected


def test_a_planned_model_is_exact_on_cuda():
    model = seeded(lambda: tiny_sequential(6, 256)).cuda()
    x = torch.randn(64, 256, device="cuda")
    expected = _step(model, x)
    plan = acshim.plan(model, x, 0.5, verify=False)
    plan.apply(model)
    _equal(_step(model, x), expected)


def test_a_tensor_made_on_a_side_stream_is_offloaded_exactly():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(256, 256).cuda(), torch.nn.Linear(256, 256).cuda()
    x = torch.randn(64, 256, device="cuda")
    side = torch.cuda.Stream()

    def forward():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            h = a(x).tanh()
        torch.cuda.current_stream().wait_stream(side)
        h.record_stream(torch.cuda.current_stream())
        return (b(h).tanh() * h).exp().sum()

    params = [*a.parameters(), *b.parameters()]
    expected = torch.autograd.grad(forward(), params)
    with offload("host", 2, min_bytes=0):
        loss = forward()
    _equal(list(torch.autograd.grad(loss, params)), list(expected))
