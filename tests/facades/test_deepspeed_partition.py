"""DeepSpeed ``partition_activations`` in one process: the mp_size edge cases, upstream's shard layout
(checked through a stand-in all-gather), hollowing, contiguous buffers and the host tier.
(Real 2-rank runs against DeepSpeed 0.19.8: tests/distributed/test_deepspeed_partition.py.)"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from acshim import partition
from acshim.facades import deepspeed
from acshim.facades.deepspeed.runtime.activation_checkpointing._state import STATE
from acshim.storage import recording

ckpt = deepspeed.checkpointing
MODES = {"reentrant": ckpt.checkpoint, "non_reentrant": ckpt.non_reentrant_checkpoint}


@pytest.fixture(autouse=True)
def fresh_state():
    STATE.reset()
    ckpt.get_cuda_rng_tracker().reset()
    yield
    STATE.reset()
    ckpt.get_cuda_rng_tracker().reset()


class Rank:
    """``mp_rank`` of a fake 2-rank group whose peer holds the same activations: the stand-in
    all-gather writes the peer's slices from the tensors the test registers, so a wrong layout
    (offset, order, padding) gives wrong inputs to the recompute."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, rank: int, size: int = 2) -> None:
        self.rank, self.size, self.sources, self.calls = rank, size, [], []
        ckpt.mp_rank, ckpt.mp_size, ckpt.mp_group = rank, size, "mp-group"
        monkeypatch.setattr(dist, "all_gather_into_tensor", self.all_gather)

    def all_gather(self, output: torch.Tensor, part: torch.Tensor, group=None) -> None:
        self.calls.append(group)
        n = part.numel()
        assert output.numel() == n * self.size and part.data_ptr() == output[n * self.rank:].data_ptr()
        source = next(s for s in self.sources if s.numel() == output.numel()
                      and torch.equal(s.reshape(-1)[n * self.rank:n * (self.rank + 1)], part))
        for peer in range(self.size):
            if peer != self.rank:
                output[n * peer:n * (peer + 1)] = source.reshape(-1)[n * peer:n * (peer + 1)]


def stack(width: int = 6, layers: int = 3) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.Dropout(0.3), nn.Tanh()) for _ in range(layers)))


def run(model: nn.Sequential, x: torch.Tensor, checkpoint=None, rank: Rank | None = None) -> list[torch.Tensor]:
    torch.manual_seed(5)
    hidden = x * 1.0
    for block in model:
        if rank is not None:
            rank.sources.append(hidden.detach().clone())
        hidden = checkpoint(block, hidden) if checkpoint else block(hidden)
    hidden.sum().backward()
    return [x.grad, *(p.grad for p in model.parameters())]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mp_rank", [0, 1])
def test_each_rank_keeps_its_slice_and_the_gather_rebuilds_exact_inputs(monkeypatch, mode, mp_rank):
    ckpt.PARTITION_ACTIVATIONS = True
    rank = Rank(monkeypatch, mp_rank)
    model, reference = stack(), stack()
    x = torch.randn(4, 6, requires_grad=True)
    expected = run(reference, x.detach().clone().requires_grad_())
    actual = run(model, x, MODES[mode], rank)
    assert all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True))
    assert rank.calls == ["mp-group"] * 3  # one gather per checkpoint input, on the mpu's group


def test_shard_is_the_flat_rank_major_slice_and_the_input_is_hollowed_until_backward(monkeypatch):
    ckpt.PARTITION_ACTIVATIONS = True
    rank = Rank(monkeypatch, 1)
    x = torch.arange(8.0).view(2, 4).t().requires_grad_()  # not contiguous: upstream flattens a contiguous copy
    hidden = x * 1.0
    rank.sources.append(hidden.detach().clone())
    shards = []
    original = partition.Shard.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        shards.append(self)

    monkeypatch.setattr(partition.Shard, "__init__", spy)
    out = ckpt.checkpoint(torch.sin, hidden)
    assert hidden.shape == () and partition.is_hollow(hidden)  # upstream: 0-dim until backward
    assert torch.equal(shards[0].data, hidden.new_tensor([2.0, 6.0, 3.0, 7.0]))  # row-major elements 4..7
    with pytest.raises(RuntimeError, match="deallocated by a previous activation checkpoint"):
        ckpt.checkpoint(torch.cos, hidden)
    out.sum().backward()
    assert hidden.shape == (4, 2) and not partition.is_hollow(hidden)
    assert torch.equal(hidden, x.detach() * 1.0) and torch.equal(x.grad, x.detach().cos())


def test_size_not_divisible_by_mp_size_asserts_before_running(monkeypatch):
    ckpt.PARTITION_ACTIVATIONS = True
    Rank(monkeypatch, 0)
    calls = []
    x = torch.randn(3, 5, requires_grad=True)  # 15 elements, 2 ranks
    with pytest.raises(AssertionError, match="^Doesn't handle if partition activation if item is not divisible by mp size$"):
        ckpt.checkpoint(lambda t: calls.append(t) or t * 2, x)
    assert calls == [] and x.shape == (3, 5)


def test_tiny_non_float_and_marked_tensors_are_kept_whole(monkeypatch):
    ckpt.PARTITION_ACTIVATIONS = True
    rank = Rank(monkeypatch, 1)
    x = torch.randn(4, 3, requires_grad=True)
    hidden = x * 1.0
    rank.sources.append(hidden.detach().clone())
    scale = torch.full((1,), 0.5, requires_grad=True)  # fewer elements than ranks
    mask = torch.tensor([1, 0, 1])
    bias = torch.randn(3, 3, requires_grad=True)
    bias.no_checkpointing = True
    out = ckpt.checkpoint(lambda h, s, m, b: (h @ b) * s * m, hidden, scale, mask, bias)
    assert hidden.shape == () and scale.shape == (1,) and mask.shape == (3,) and bias.shape == (3, 3)
    out.sum().backward()
    assert len(rank.calls) == 1 and hidden.shape == (4, 3)
    reference = [t.detach().clone().requires_grad_() for t in (x, scale, bias)]
    ((reference[0] @ reference[2]) * reference[1] * mask).sum().backward()
    assert all(torch.equal(t.grad, r.grad) for t, r in zip((x, scale, bias), reference))


@pytest.mark.parametrize("mode", MODES)
def test_contiguous_buffers_are_preallocated_used_and_overflow_past_num_checkpoints(mode):
    ckpt.configure(None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=2)
    layer = nn.Linear(6, 6)
    reference = copy.deepcopy(layer)
    x = torch.randn(2, 6, requires_grad=True)
    first = layer(x)
    second = MODES[mode](layer, first)
    buffers = ckpt.contiguous_data_buffers
    assert len(buffers) == 1 and [tuple(b.shape) for b in buffers[0]] == [(12,), (12,)]
    assert torch.equal(buffers[0][0], layer(x).detach().view(-1)) and ckpt.data_offsets == [1]
    third = MODES[mode](layer, second)
    assert ckpt.data_offsets == [2] and ckpt.size_offsets == [4]
    assert ckpt.contiguous_size_buffers[0].tolist() == [2, 6, 2, 6]
    with pytest.raises(IndexError, match="list index out of range"):  # upstream's error
        MODES[mode](layer, third)
    third.sum().backward()
    assert ckpt.contiguous_data_buffers == [] and ckpt.data_offsets == []  # the first backward drops them
    expected = x.detach().clone().requires_grad_()
    reference(reference(reference(expected))).sum().backward()
    assert torch.equal(x.grad, expected.grad) and torch.equal(layer.weight.grad, reference.weight.grad)
    fourth = MODES[mode](layer, layer(x))  # fresh buffers after the backward
    assert ckpt.data_offsets == [1]
    ckpt.reset()
    assert ckpt.contiguous_data_buffers == []
    fourth.sum().backward()


def test_cpu_checkpointing_with_partition_stores_shards_on_the_host_tier(monkeypatch):
    ckpt.configure(None, partition_activations=True, checkpoint_in_cpu=True)
    rank = Rank(monkeypatch, 0)
    model, reference = stack(), stack()
    x = torch.randn(4, 6, requires_grad=True)
    expected = run(reference, x.detach().clone().requires_grad_())
    with recording() as sessions:
        actual = run(model, x, ckpt.checkpoint, rank)
    assert all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True))
    (session,) = sessions
    assert session.stats.saved == 3 and session.storage == "host"  # each shard went through the host tier


def test_no_grad_partitions_nothing():
    ckpt.configure(None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=1)
    x = torch.randn(4)
    with torch.no_grad():
        for _ in range(3):  # upstream: IndexError on the second call and x hollowed forever
            ckpt.checkpoint(torch.sin, x)
    assert x.shape == (4,) and ckpt.contiguous_data_buffers == []


@pytest.mark.parametrize("mode", MODES)
def test_an_input_the_region_never_unpacks_is_given_back_when_its_gradient_arrives(mode):
    ckpt.PARTITION_ACTIVATIONS = True
    x = torch.randn(4, requires_grad=True)
    out = MODES[mode](lambda t: t * 2, x)  # saves nothing: non-reentrant never recomputes
    assert x.shape == ()
    out.sum().backward()
    assert x.shape == (4,) and torch.equal(x.grad, torch.full((4,), 2.0))  # upstream: x stays empty
    out = MODES[mode](lambda t: t * 2, x)  # a second step: the previous step's hook is replaced
    out.sum().backward()
    assert x.shape == (4,) and len(x._backward_hooks) == 1
    key = id(x)
    assert key in partition._GRAD_HOOKS
    del x, out
    assert key not in partition._GRAD_HOOKS  # the registry entry dies with its tensor
