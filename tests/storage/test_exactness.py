"""Offloading never changes results: gradients bitwise equal to the in-memory step, every tier,
both I/O paths, every horizon, both scopes, both checkpointing modes, dropout on. Tests taking
``runtime`` run on the CPU backend and on the CUDA backend over the simulated CUDA runtime
(``acshim.backends.simcuda``: stream ordering checked, lazy and random execution)."""

from __future__ import annotations

import pytest
import torch

import acshim
from acshim.storage import boundary_offload, no_offload, offload
from acshim.storage.layout import from_bytes, movable, to_bytes
from acshim.testing import assert_bitwise_equal, hf_inputs, hf_model, seeded, tiny_sequential, train_step

TIERS = [("host", None), ("disk", True), ("disk", False)]  # (storage, native I/O)


@pytest.mark.parametrize("storage,native", TIERS)
@pytest.mark.parametrize("prefetch", [0, 2])
def test_offload_scope_gradients_bitwise_equal(storage, native, prefetch, disk_dir, offloaded, mlp_input, runtime):
    model = seeded(lambda: tiny_sequential(3, 64))
    expected = train_step(model, mlp_input)
    wrapped = offloaded(model, lambda: offload(storage, prefetch, disk_dir, min_bytes=0, native=native))
    assert_bitwise_equal(expected, train_step(wrapped, mlp_input))
    stats = wrapped.scopes[-1].stats
    if storage == "disk" or runtime.host_moves:
        assert stats.moved > 0 and stats.fetched == stats.sent_out == stats.moved - prefetch


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("storage,native", TIERS)
def test_boundary_offload_gradients_bitwise_equal(reentrant, storage, native, disk_dir, mlp_input, runtime):
    expected = train_step(seeded(lambda: tiny_sequential(4, 64)), mlp_input)
    model = seeded(lambda: tiny_sequential(4, 64))
    scope = boundary_offload(storage, prefetch=1, directory=disk_dir, min_bytes=0, native=native)
    acshim.apply_checkpointing(model, saved_tensors_scope=scope, reentrant=reentrant)
    for _ in range(2):  # the shared schedule carries over steps
        assert_bitwise_equal(expected, train_step(model, mlp_input))
    assert scope.stats.moved == (8 if storage == "disk" or runtime.host_moves else 0)


def test_gpt2_disk_tier_with_checkpointing_inside_gradients_bitwise_equal(disk_dir, offloaded, runtime):
    model = hf_model("gpt2")
    inputs = dict(hf_inputs("gpt2"), use_cache=False)
    expected = train_step(model, inputs, loss_fn=lambda out: out.loss)
    wrapped = offloaded(model, lambda: offload("disk", 2, disk_dir, min_bytes=0))
    assert_bitwise_equal(expected, train_step(wrapped, inputs, loss_fn=lambda out: out.loss))
    assert wrapped.scopes[-1].stats.moved > 20
    acshim.apply_checkpointing(model)  # offload_wrapper(checkpointed model): only boundary inputs reach it
    assert_bitwise_equal(expected, train_step(wrapped, inputs, loss_fn=lambda out: out.loss))
    assert 0 < wrapped.scopes[-1].stats.moved < 20


@pytest.mark.parametrize("make", [
    lambda: torch.randn(8, 6).t(),                       # transposed: strides (1, 6)
    lambda: torch.randn(5).expand(4, 5),                 # stride 0
    lambda: torch.randn(10, 10)[2:7, 1:9:3],             # offset slice with step
    lambda: torch.randn(4, 4, dtype=torch.complex64),
    lambda: torch.randint(0, 2, (33,), dtype=torch.bool),
])
def test_views_come_back_with_same_shape_strides_and_bits(make, disk_dir):
    from acshim.storage.disk import DiskTier
    from acshim.storage.native import file_io

    tensor = make()
    data, layout = to_bytes(tensor)
    tier = DiskTier(file_io(False), disk_dir)
    back = from_bytes(tier.read(tier.write(data.contiguous())), layout)
    assert back.stride() == tensor.stride() and back.shape == tensor.shape and back.dtype == tensor.dtype
    assert torch.equal(back, tensor)


def test_parameters_views_of_parameters_and_small_tensors_stay_put():
    weight = torch.nn.Parameter(torch.randn(64, 64))
    assert not movable(weight, 0) and not movable(weight.t(), 0)
    assert not movable(torch.randn(10), min_bytes=41) and movable(torch.randn(10), min_bytes=40)


def test_tensor_saved_twice_is_moved_once(disk_dir, runtime):
    x = torch.randn(64, 64, requires_grad=True)
    with offload("disk", 0, disk_dir, min_bytes=0) as scope:
        y = x.sin()
        loss = (y * y).sum()  # mul saves y twice
    loss.backward()
    # sin saves x (a leaf that requires grad: stays, like a parameter); mul saves y twice: moved once
    assert (scope.stats.saved, scope.stats.kept, scope.stats.moved, scope.stats.fetched) == (3, 1, 1, 1)
    assert torch.equal(x.grad, 2 * x.sin() * x.cos())


def test_retain_graph_second_backward_gives_same_grads(disk_dir, runtime):
    x = torch.randn(32, 32, requires_grad=True)
    with offload("disk", 1, disk_dir, min_bytes=0):
        loss = x.exp().tanh().sum()
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    x.grad = None
    loss.backward()
    assert torch.equal(first, x.grad)


def test_no_offload_keeps_its_region_in_memory_in_both_scopes(disk_dir, runtime):
    x = torch.randn(64, 64, requires_grad=True)
    with offload("disk", 0, disk_dir, min_bytes=0) as scope:
        a = x.exp()
        with no_offload():
            b = a.sin()
    b.sum().backward()
    assert (scope.stats.saved, scope.stats.moved) == (1, 1)  # exp's output moved; sin's input did not reach it
    boundary = boundary_offload("disk", 0, disk_dir, min_bytes=0)
    model = seeded(lambda: tiny_sequential(2, 64))
    acshim.apply_checkpointing(model, saved_tensors_scope=boundary)
    with no_offload():
        model(torch.randn(4, 64)).sum().backward()
    assert boundary.stats.saved == 2 and boundary.stats.moved == 0
