"""The budget's baseline is read on the model's device (issue 26; the H200 run of 2026-11-27): on a
GPU, what the caching allocator reserved when the first planned step started, not the process's
anonymous CPU memory, which every later reading (reserved bytes) was taken from before. This
machine has no GPU: the allocator's counters are set by the test."""

from __future__ import annotations

import pytest
import torch

from acshim.planner.process import ProcessMemory
from acshim.planner.session import PlanSession
from acshim.planner.steps import StepStart, device_key, held_now

MIB = 2**20


class _FakeCuda:
    """One CUDA device whose caching allocator reserves what the test says."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, reserved: int) -> None:
        self.reserved = reserved
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.reserved)
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)


def _step_started(session: PlanSession) -> None:
    """What ``acshim run --budget`` sees of a step: its outermost module call, with grad."""
    session._memory = ProcessMemory("cpu")
    session._start = StepStart(session._memory).start()
    torch.nn.Linear(2, 2)(torch.ones(1, 2))


def test_a_cuda_models_baseline_is_the_reserved_memory_at_the_steps_start(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = _FakeCuda(monkeypatch, reserved=700 * MIB)
    session = PlanSession(budget=100 * MIB)
    _step_started(session)
    cpu_at_start = session._start.held["cpu"]
    assert cpu_at_start > 0 and cpu_at_start != 700 * MIB
    cuda.reserved = 900 * MIB                       # the step's forward has run on since
    session._take_baseline(torch.device("cuda", 0))
    assert session._memory.device.type == "cuda"    # every later reading is the allocator's
    assert session._baseline == 700 * MIB           # from the step's start, on the same device
    assert session._memory.current() - session._baseline == 200 * MIB


def test_a_cpu_models_baseline_stays_the_process_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    _FakeCuda(monkeypatch, reserved=700 * MIB)      # CUDA started, but the model is on the CPU
    session = PlanSession(budget=100 * MIB)
    _step_started(session)
    at_start = session._start.held
    session._take_baseline(torch.device("cpu"))
    assert session._memory.device.type == "cpu" and session._baseline == at_start["cpu"]


def test_acshim_plans_baseline_taken_before_the_model_is_known_is_the_models_devices(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``acshim.plan`` reads its baseline when called (``start(baseline_now=True)``), before it
    knows the model's device: it keeps every device's reading and takes the model's."""
    cuda = _FakeCuda(monkeypatch, reserved=300 * MIB)
    session = PlanSession(budget=100 * MIB, api=True)
    session._memory = ProcessMemory("cpu")
    session._held_at_start = held_now(session._memory)
    cuda.reserved = 450 * MIB
    session._take_baseline(torch.device("cuda"))
    assert device_key(torch.device("cuda")) == "cuda:0"
    assert session._baseline == 300 * MIB and session._memory.device == torch.device("cuda")
