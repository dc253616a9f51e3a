"""The planner's guard on the process's memory (``acshim.planner.process.Guard``): an operator whose
outputs would take the process over the limit is stopped before it allocates them, whatever shape
its arguments come in (single tensors, lists of tensors as ``torch.cat`` takes them); views pass."""

from __future__ import annotations

import gc
import traceback
import weakref

import pytest
import torch

from acshim.allocator import own
from acshim.planner.process import (
    BackwardDrain,
    Guard,
    OverBudget,
    ProcessMemory,
    guard_limit,
    guarded_budget,
    release_stopped,
    trim,
)

MIB = 2**20

pytestmark = pytest.mark.skipif(not ProcessMemory("cpu").available, reason="needs /proc/self/statm")


def _guard(room: int) -> Guard:
    """A guard as planning runs it: the C allocator owned (``acshim.allocator``: large tensors mapped
    fresh, not served from freed heap pages that are resident already, which a worker that never
    planned before still had: the CI run of 2026-11-27 saw a 16 MiB output as 224 KiB) and the heap
    trimmed before the baseline."""
    own()
    trim()
    memory = ProcessMemory("cpu")
    baseline = memory.current()
    return Guard(memory, baseline, limit=room)


@pytest.mark.parametrize(("name", "operation", "size"), [
    ("cat", lambda a, b: torch.cat([a, b]), 2 * 16 * MIB),                      # a list argument
    ("mm", lambda a, b: a[:, :1] @ b[:1, :], 16 * MIB),                        # outputs far larger than inputs
], ids=["cat-of-a-list", "outer-product"])
def test_an_operator_going_over_is_stopped_before_it_allocates(name: str, operation, size: int) -> None:
    a, b = torch.ones(4096, 1024), torch.ones(4096, 1024)  # 16 MiB each, before the guard
    with _guard(room=8 * MIB) as guard, pytest.raises(OverBudget) as stopped:
        operation(a, b)
    assert name in stopped.value.operator
    assert stopped.value.size == size                          # sized on the meta device, not allocated
    assert guard.peak < size // 2                              # nothing of that size was ever resident
    assert stopped.value.used > stopped.value.limit


def test_views_and_small_operators_pass_and_are_sampled() -> None:
    a = torch.ones(4096, 1024)
    with _guard(room=8 * MIB) as guard:
        view = a.view(1024, 4096).t()           # allocates nothing
        small = torch.cat([a[:8], a[8:16]])     # 64 KiB
    assert view.shape == (4096, 1024) and small.shape == (16, 1024)
    assert guard.last <= guard.peak < 8 * MIB  # sampled after each operator, never near the limit
    del view, small
    gc.collect()


def test_a_linear_on_a_batch_of_sequences_counts_its_output_once() -> None:
    """``F.linear`` on 3-d input is a matmul then ``aten::_unsafe_view`` of its result (a view whose
    schema says nothing of aliasing): the logits of a language model's head were counted twice, and
    planning a LoRA Llama with a 32k vocabulary was stopped at budgets it fits."""
    hidden, weight = torch.randn(4, 1024, 256), torch.randn(1024, 256)
    with _guard(room=26 * MIB) as guard:
        logits = torch.nn.functional.linear(hidden, weight)   # 16 MiB, once
    assert logits.shape == (4, 1024, 1024)
    assert 15 * MIB < guard.peak < 26 * MIB
    with _guard(room=12 * MIB), pytest.raises(OverBudget) as stopped:
        torch.nn.functional.linear(hidden, weight)             # what does not fit is still stopped
    assert stopped.value.size == 16 * MIB


class _FakeCudaCounters:
    """The CUDA caching allocator's two counters, set by the test (this machine has no GPU)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, reserved: int, allocated: int) -> None:
        self.reserved, self.allocated, self.emptied = reserved, allocated, 0
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "empty_cache", self._empty)

    def _empty(self) -> None:
        self.emptied += 1
        self.reserved = self.allocated


@pytest.mark.parametrize("cached", [6 * MIB, 0], ids=["cache-holds-it", "no-cache"])
def test_on_cuda_outputs_the_cache_can_hold_are_not_charged_before_they_run(monkeypatch: pytest.MonkeyPatch,
                                                                            cached: int) -> None:
    """On a GPU the guard's unit is reserved memory, which freed tensors do not lower: an operator
    whose 4 MiB output fits in the 6 MiB the allocator has cached adds nothing to it, so it runs
    under a limit 8 MiB above a start 6 MiB below it (the GPU run of 2026-11-27 stopped such
    measurements, refusing budgets that plan). Without that cache it is stopped before it runs."""
    counters = _FakeCudaCounters(monkeypatch, reserved=100 * MIB + 6 * MIB, allocated=100 * MIB + 6 * MIB - cached)
    memory = ProcessMemory("cuda")
    assert memory.reusable() == cached
    left, right = torch.ones(1024, 1), torch.ones(1, 1024)  # a 4 MiB outer product
    with Guard(memory, 100 * MIB, limit=8 * MIB) as guard:
        if cached:
            assert (left @ right).shape == (1024, 1024)
            assert guard.peak == 6 * MIB          # sampled after it ran, as reserved memory
        else:
            with pytest.raises(OverBudget) as stopped:
                left @ right
            assert stopped.value.used == 10 * MIB and stopped.value.size == 4 * MIB
    assert counters.emptied == 0                  # a guard never empties the cache by itself


def test_a_measurement_starts_without_the_last_ones_cuda_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """``trim()`` (called where every measurement and baseline starts) gives the caching allocator's
    free blocks back once CUDA has started, so reserved memory starts at what tensors hold."""
    counters = _FakeCudaCounters(monkeypatch, reserved=300 * MIB, allocated=120 * MIB)
    memory = ProcessMemory("cuda")
    with Guard(memory, 0) as guard:
        guard.open_window("block 0 kept")
    assert counters.emptied == 1 and memory.current() == 120 * MIB and guard.window_peak == 120 * MIB
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    trim()
    assert counters.emptied == 1                  # CUDA never started: nothing to give back


def test_code_paged_in_counts_against_the_limit_and_never_as_a_measurements_bytes(tmp_path) -> None:
    """File-backed pages (library code, mapped files) mapped since the step's start count against a
    guard's limit when it has a ``file_baseline`` (``VmHWM`` counts them), and never in ``used``,
    the bytes measurements are made of (the session charges them once)."""
    import mmap
    import os

    memory = ProcessMemory("cpu")
    if not memory.available:
        pytest.skip("needs /proc/self/statm")
    path = tmp_path / "mapped.bin"
    path.write_bytes(os.urandom(8 << 20))
    start = memory.file_backed()
    counting = Guard(memory, memory.current(), 4 << 20, file_baseline=start)
    blind = Guard(memory, memory.current(), 4 << 20)
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        checksum = sum(mapped[offset] for offset in range(0, len(mapped), mmap.PAGESIZE))  # every page read
        assert memory.file_backed() - start >= 7 << 20
        assert counting.used() < 2 << 20 and counting.current_limit() < 0
        with blind:
            torch.ones(8).add_(1)
        with pytest.raises(OverBudget), counting:
            torch.ones(8).add_(checksum)
    assert counting.peak < 2 << 20  # what it measured: anonymous memory only


def test_a_measurement_stopped_in_backward_frees_its_graph_however_long_its_traceback_lives() -> None:
    """A stop raised inside autograd's engine: the unwound frames hold the step's loss, and with it
    the graph and its saved tensors. Planning under ``acshim run --budget`` on HF GPT-2 saw those
    frames outlive the caught exception with no Python object referring to them (held from C++), so
    the next measurement started holding the stopped one's peak and was stopped at once. Here the
    traceback is kept alive as that holder kept it: ``release_stopped`` frees the saved activation
    anyway, and without it the activation stays."""
    layer = torch.nn.Linear(256, 1024)
    inputs = torch.randn(512, 256)
    kept: dict[str, object] = {}

    def step() -> None:
        hidden = torch.nn.functional.gelu(layer(inputs))  # saved for backward: 2 MiB
        kept["saved"] = weakref.ref(hidden)
        loss = hidden.square().sum()
        del hidden
        loss.backward()

    for release in (False, True):
        with _guard(room=1024 * MIB) as guard:
            guard.limit = lambda: 1024 * MIB if torch.is_grad_enabled() and not _in_backward() else 0
            try:
                step()
            except OverBudget as error:
                traceback_held = error.__traceback__  # what the engine kept
                if release:
                    release_stopped(error)
            guard.limit = None
        gc.collect()
        assert (kept["saved"]() is None) == release, release
        del traceback_held


def test_a_backward_stopped_midway_leaves_no_queued_node_holding_saved_tensors() -> None:
    """A stop raised by one node of a backward while another node waits in the engine's queue: on
    CPU that node (and what it saved) stayed queued until the thread's next backward (a GPT-2
    block's stopped ``recompute`` kept 19.7 MiB into the next measurement, which was stopped too).
    With the unwound frames cleared either way, the waiting node's saved tensor stays alive without
    ``release_stopped``'s drain and is freed with it, the drain running no operator (a stop inside
    the counting forward releases with the guard still entered and over its limit)."""
    class Packed:  # what a saved tensor is packed into, watched by a weak reference
        def __init__(self, tensor: torch.Tensor) -> None:
            self.tensor = tensor

    watched: list[weakref.ref] = []

    def pack(tensor: torch.Tensor) -> Packed:
        packed = Packed(tensor)
        watched.append(weakref.ref(packed))
        return packed

    class Stop(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
            raise OverBudget(1, 0, "a test's backward")

    BackwardDrain.prepare()  # as a guard does, before the graphs it may stop
    leaf = torch.randn(64, 64, requires_grad=True)
    for release in (False, True):
        watched.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda packed: packed.tensor):
            waiting = (leaf * 1.0).sin()  # queued when the stop raises (older nodes are served last)
        stopped = Stop.apply(leaf)
        loss = waiting.sum() + stopped.sum()
        del waiting, stopped
        with pytest.raises(OverBudget) as caught:
            loss.backward()
        del loss
        if release:  # as inside the counting forward: the guard still entered, over its limit
            with _guard(room=0) as guard:
                guard.limit = -1
                release_stopped(caught.value)  # runs no operator the guard could stop
        else:
            traceback.clear_frames(caught.value.__traceback__)
        del caught
        gc.collect()
        assert watched and all(ref() is None for ref in watched) == release, release
    BackwardDrain.run()


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


@pytest.mark.parametrize("needed", [1, 3 * MIB + 5, 40 * MIB, 76 * MIB - 1, 76 * MIB, 200 * MIB + 7, 396 * MIB,
                                    397 * MIB, 3000 * MIB + 1])
def test_guarded_budget_is_the_least_budget_whose_guard_lets_a_measurement_reach_it(needed: int) -> None:
    """``least_budget`` turns what measurements reached into a budget with ``guarded_budget``: at it
    the guard lets them through, one byte less it would not; the guard's margin is 5% of the budget,
    at most 4 MiB, at least 1%."""
    budget = guarded_budget(needed)
    assert guard_limit(budget) >= needed > guard_limit(budget - 1)
    margin = budget - guard_limit(budget)
    assert max(0.01 * budget, min(0.05 * budget, 4 * MIB)) - 1 <= margin <= max(0.01 * budget, min(0.05 * budget, 4 * MIB)) + 1
