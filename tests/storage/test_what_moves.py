"""Bytes that should not move (issue 19, item 6): parameters, frozen or not, their views and module
buffers stay where they are (the module keeps them: moving them only copies them every layer, every
step); each storage byte of the activations moves once, on every path that reaches the storage tier
(q, k and v of one ``split`` are three views of one storage); the DeepSpeed hidden-state facade
keeps no handle of a finished step. Runs on the CPU backend with the disk tier (which moves CPU
tensors): what moves does not depend on the device."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import acshim
from acshim.options import RegionOptions
from acshim.selective import offload_policies
from acshim.storage import boundary_offload, offload, recording
from acshim.storage.layout import movable
from acshim.storage.offload_session import OffloadSession
from acshim.storage.reaper import REAPER
from acshim.testing import hf_inputs, hf_model


def _unique_movable_bytes(run) -> int:
    """Bytes of the distinct storages of the tensors ``run()`` saves that the tier would move."""
    unique: dict[int, int] = {}

    def note(tensor):
        if movable(tensor, 0):
            storage = tensor.untyped_storage()
            unique[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(note, lambda tensor: tensor):
        run()
    return sum(unique.values())


def test_a_frozen_weights_transpose_stays(disk_dir):
    """A LoRA-frozen linear saves ``weight.t()`` (a view of a parameter that needs no gradient)."""
    layer = nn.Linear(64, 64)
    layer.requires_grad_(False)
    x = torch.randn(32, 64, requires_grad=True)
    with offload("disk", 0, disk_dir, min_bytes=0) as scope:
        y = layer(x)
    y.sum().backward()
    assert scope.stats.saved >= 1 and scope.stats.moved == 0, scope.stats
    assert torch.equal(x.grad, torch.ones(32, 64) @ layer.weight)


class _Masked(nn.Module):
    """A module that multiplies by a slice of a registered buffer, and a frozen (eval) BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", torch.rand(128, 64))
        self.norm = nn.BatchNorm1d(64).eval()  # running statistics are saved in eval mode
        self.lin = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.norm(x * self.mask[: x.shape[0]]))


def test_module_buffers_and_their_views_stay(disk_dir, monkeypatch):
    torch.manual_seed(0)
    model = _Masked()
    x = torch.randn(32, 64, requires_grad=True)
    expected = torch.autograd.grad(model(x).square().sum(), x)[0]
    buffers = {buffer.untyped_storage().data_ptr() for buffer in model.buffers()}
    moved = []
    original = OffloadSession.pack

    def pack(session, tensor):
        handle = original(session, tensor)
        if type(handle) is not tuple:
            moved.append(tensor.untyped_storage().data_ptr())
        return handle

    monkeypatch.setattr(OffloadSession, "pack", pack)
    with offload("disk", 0, disk_dir, min_bytes=0):
        loss = model(x).square().sum()
    assert not torch.nn.modules.module._global_forward_pre_hooks  # the noting hook lives in the block only
    got = torch.autograd.grad(loss, x)[0]
    assert torch.equal(got, expected)
    assert moved and not buffers & set(moved), "a module buffer (or a view of one) was moved"


# ---------------------------------------------------------------------------- one storage, moved once


def _qkv(width: int = 64):
    torch.manual_seed(0)
    lin = nn.Linear(width, 3 * width)
    x = torch.randn(2, 16, width, requires_grad=True)
    return lin, x


def _attention(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def _reference(lin, x):
    q, k, v = lin(x).split(64, dim=-1)
    return torch.autograd.grad(_attention(q, k, v).square().sum(), (x, lin.weight))


@pytest.mark.parametrize("path", ["offload", "boundary-reentrant", "boundary-non-reentrant", "selective-policy"])
def test_q_k_v_of_one_split_move_their_storage_once(path, disk_dir):
    lin, x = _qkv()
    expected = _reference(lin, x)
    storage_bytes = 2 * 16 * 3 * 64 * 4
    if path == "offload":
        def forward():
            q, k, v = lin(x).split(64, dim=-1)
            return _attention(q, k, v)  # saves q, k and v (and its own outputs)

        unique = _unique_movable_bytes(forward)
        with offload("disk", 0, disk_dir, min_bytes=0) as scope:
            out = forward()
        got = torch.autograd.grad(out.square().sum(), (x, lin.weight))
        assert scope.stats.moved_bytes == unique, scope.stats
    elif path.startswith("boundary"):
        scope = boundary_offload("disk", 0, disk_dir, min_bytes=0)
        q, k, v = lin(x).split(64, dim=-1)
        options = RegionOptions(reentrant=path == "boundary-reentrant", saved_tensors_scope=scope)
        out = acshim.run_region(_attention, (q, k, v), {}, options)
        out.square().sum().backward()  # reentrant regions refuse .grad()
        got = (x.grad, lin.weight.grad)
        stats = scope.stats
        assert stats.moved_bytes == storage_bytes, stats  # the region's inputs: one storage
    else:
        def policy(ctx, op, *args, **kwargs):
            if op is torch.ops.aten.split.Tensor:
                return CheckpointPolicy.MUST_CPU_OFFLOAD
            return CheckpointPolicy.PREFER_RECOMPUTE

        with recording() as sessions:
            context_fn = offload_policies(lambda: create_selective_checkpoint_contexts(policy), storage="disk",
                                          prefetch=0, directory=disk_dir, min_bytes=0)

        def block(h):
            q, k, v = lin(h).split(64, dim=-1)
            return _attention(q, k, v)

        out = acshim.run_region(block, (x,), {}, RegionOptions(reentrant=False, context_fn=context_fn))
        got = torch.autograd.grad(out.square().sum(), (x, lin.weight))
        moved = sum(s.stats.moved_bytes for s in sessions)
        assert moved == storage_bytes, [s.stats for s in sessions]  # split's three outputs: one storage
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


def test_gpt2_moves_exactly_its_unique_activation_storage_bytes(disk_dir):
    model = hf_model("gpt2")
    inputs = dict(hf_inputs("gpt2"), use_cache=False)
    torch.manual_seed(0)
    unique = _unique_movable_bytes(lambda: model(**inputs).loss)
    torch.manual_seed(0)
    with offload("disk", 0, disk_dir, min_bytes=0) as scope:
        loss = model(**inputs).loss
    loss.backward()
    assert scope.stats.moved_bytes == unique


# ------------------------------------------------------------------------------ DeepSpeed's facade


def test_deepspeed_hidden_state_offload_keeps_no_handle_of_a_finished_step(disk_dir, spill_in):
    from acshim.facades.deepspeed.runtime.activation_checkpointing import offload_activations as facade

    manager = facade.CheckpointHiddenStatesOffload(min_offload_bytes=0, keep_last_count=0, storage="disk",
                                                   directory=disk_dir)
    x = torch.randn(64, 64, requires_grad=True)
    for _ in range(2):
        with manager:
            h = x * 1
            manager.mark(h)
            loss = h.sin().sum()
        assert manager.stats.offloaded_tensors == 1
        loss.backward()
        del loss, h
        gc.collect()
        assert REAPER.settle()
        assert spill_in(disk_dir) == 0  # the step's slot was freed with its graph
