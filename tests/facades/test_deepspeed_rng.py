"""DeepSpeed facade: CudaRNGStatesTracker, get_cuda_rng_tracker and the seeding functions."""

from __future__ import annotations

import pytest
import torch

import acshim
from acshim.facades import deepspeed
from acshim.facades.deepspeed.runtime.activation_checkpointing._state import STATE

ckpt = deepspeed.checkpointing


@pytest.fixture(autouse=True)
def fresh_state():
    STATE.reset()
    ckpt.get_cuda_rng_tracker().reset()
    outer = torch.get_rng_state()
    yield
    torch.set_rng_state(outer)
    STATE.reset()
    ckpt.get_cuda_rng_tracker().reset()


class Unit:
    def __init__(self, tp_rank):
        self.tp_rank = tp_rank

    def get_tensor_model_parallel_rank(self):
        return self.tp_rank

    def get_data_parallel_rank(self):
        return 0


class SliceUnit:
    def get_slice_parallel_rank(self):
        return 3

    def get_data_parallel_rank(self):
        return 0


def state_after_seed(seed: int) -> torch.Tensor:
    outer = torch.get_rng_state()
    torch.manual_seed(seed)
    state = torch.get_rng_state()
    torch.set_rng_state(outer)
    return state


def test_tracker_is_a_module_singleton_the_engine_preserves():
    tracker = ckpt.get_cuda_rng_tracker()
    assert tracker is ckpt.get_cuda_rng_tracker() is ckpt._CUDA_RNG_STATE_TRACKER
    assert isinstance(tracker, ckpt.CudaRNGStatesTracker) and isinstance(tracker, acshim.RNGStatesTracker)


def test_tracker_errors_match_upstream():
    tracker = ckpt.CudaRNGStatesTracker()
    tracker.add("a", 1)
    with pytest.raises(Exception, match="^seed 1 already exists$") as seed_error:
        tracker.add("b", 1)
    assert type(seed_error.value) is Exception
    with pytest.raises(Exception, match="^cuda rng state a already exists$"):
        tracker.add("a", 2)
    with pytest.raises(Exception, match="^seed 2 already exists$"):  # the failed add consumed seed 2
        tracker.add("c", 2)
    with pytest.raises(Exception, match="^cuda rng state missing is not added$"):
        with tracker.fork("missing"):
            pass


def test_fork_runs_on_the_stream_and_restores_the_outer_state_even_on_error():
    tracker = ckpt.CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 99)
    torch.manual_seed(0)
    outer = torch.get_rng_state()
    with tracker.fork():
        first = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outer)
    with pytest.raises(ValueError):
        with tracker.fork():
            second = torch.rand(3)
            raise ValueError
    assert torch.equal(torch.get_rng_state(), outer)
    torch.manual_seed(99)
    assert torch.equal(first, torch.rand(3)) and torch.equal(second, torch.rand(3))  # the stream advanced


def test_get_and_set_states_are_shallow_and_unchecked():
    tracker = ckpt.CudaRNGStatesTracker()
    tracker.add("x", 5)
    states = tracker.get_states()
    states["y"] = "anything"
    assert "y" not in tracker.states_
    tracker.set_states(states)
    assert tracker.states_ is states
    tracker.reset()
    assert tracker.states_ == {} and tracker.seeds_ == set()


@pytest.mark.parametrize("unit,tp_rank", [(None, 0), (Unit(1), 1), (SliceUnit(), 3)])
def test_model_parallel_seed_offsets_the_tracked_stream_by_2718_plus_tp_rank(unit, tp_rank):
    ckpt.mpu = unit  # without an mpu upstream fails on rank 0; here it seeds with tp rank 0
    ckpt.model_parallel_cuda_manual_seed(10)
    assert torch.equal(torch.get_rng_state(), state_after_seed(10))
    tracked = ckpt.get_cuda_rng_tracker().get_states()["model-parallel-rng"]
    assert torch.equal(tracked, state_after_seed(10 + 2718 + tp_rank))
    ckpt.model_parallel_cuda_manual_seed(10)  # a second call resets first, so no "already exists"


def test_reconfigure_tp_seed_rewrites_only_the_tracked_stream():
    with pytest.raises(Exception, match="cuda rng state model-parallel-rng is not added"):
        ckpt.model_parallel_reconfigure_tp_seed(1)
    ckpt.mpu = Unit(2)
    ckpt.model_parallel_cuda_manual_seed(10)
    default_state = torch.get_rng_state()
    ckpt.model_parallel_reconfigure_tp_seed(50)
    assert torch.equal(torch.get_rng_state(), default_state)
    tracked = ckpt.get_cuda_rng_tracker().get_states()["model-parallel-rng"]
    assert torch.equal(tracked, state_after_seed(50 + 2718 + 2))


def test_set_cuda_rng_state_installs_the_state():
    wanted = state_after_seed(77)
    ckpt._set_cuda_rng_state(wanted)
    assert torch.equal(torch.get_rng_state(), wanted)
