"""The megatron facade's RNG tracker and ``checkpoint`` (megatron-core 0.16.1 tensor_parallel/random.py)
on their own: stream seeds, upstream's fork bookkeeping and errors, and a checkpoint whose dropout
draws from a tracker stream recomputing bitwise. Runs without megatron-core (the facade alone)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from acshim.facades.megatron.core.tensor_parallel import random as mrandom


@pytest.fixture
def tracker() -> Iterator[mrandom.CudaRNGStatesTracker]:
    mrandom.model_parallel_cuda_manual_seed(1234, tp_rank=1, ep_rank=2, etp_rank=3, force_reset_rng=True)
    yield mrandom.get_cuda_rng_tracker()
    mrandom.get_cuda_rng_tracker().reset()


def _state_of(seed: int) -> torch.Tensor:
    outer = torch.get_rng_state()
    torch.manual_seed(seed)
    state = torch.get_rng_state()
    torch.set_rng_state(outer)
    return state


def test_manual_seed_adds_upstreams_three_streams_with_upstreams_seeds(tracker: mrandom.CudaRNGStatesTracker) -> None:
    states = tracker.get_states()
    assert torch.equal(states["data-parallel-rng"], _state_of(1234))
    assert torch.equal(states["model-parallel-rng"], _state_of(1234 + 2718 + 1))
    assert torch.equal(states["expert-parallel-rng"], _state_of(1234 + 1024 + 100 * 2 + 3))
    assert tracker.is_initialized()
    with pytest.raises(Exception, match="seed 1234 already exists"):
        tracker.add("another", 1234)
    with pytest.raises(Exception, match="cuda rng state nope is not added"):
        with tracker.fork("nope"):
            pass


def test_nested_fork_of_the_running_stream_keeps_the_inner_draws(tracker: mrandom.CudaRNGStatesTracker) -> None:
    with tracker.fork():
        with tracker.fork():
            first = torch.rand(4)
        second = torch.rand(4)
    torch.set_rng_state(_state_of(1234 + 2718 + 1))
    expected = torch.rand(8)
    assert torch.equal(torch.cat([first, second]), expected)  # upstream: the stream never repeats a draw


def test_checkpoint_with_tracker_dropout_recomputes_bitwise_and_refuses_autograd_grad(
        tracker: mrandom.CudaRNGStatesTracker) -> None:
    weight = torch.randn(16, 16, requires_grad=True)
    calls = []

    def layer(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        with tracker.fork():
            x = torch.nn.functional.dropout(x @ weight, 0.5)
        return torch.nn.functional.dropout(x, 0.3)

    x = torch.randn(8, 16, requires_grad=True)
    states = mrandom._get_all_rng_states()
    mrandom.checkpoint(layer, False, x).pow(2).sum().backward()
    got = (x.grad.clone(), weight.grad.clone())
    assert len(calls) == 2
    x.grad, weight.grad = None, None
    mrandom._set_all_rng_states(*states)
    layer(x).pow(2).sum().backward()
    assert torch.equal(got[0], x.grad) and torch.equal(got[1], weight.grad)
    with pytest.raises(RuntimeError, match="Checkpointing is not compatible with .grad"):
        torch.autograd.grad(mrandom.checkpoint(layer, False, x).sum(), [x])


def test_unserved_options_raise_naming_the_argument() -> None:
    with pytest.raises(ValueError, match="use_cudagraphable_rng"):
        mrandom.CudaRNGStatesTracker(use_cudagraphable_rng=True)
