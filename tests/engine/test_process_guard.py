"""The planner's guard on the process's memory (``acshim.planner.process.Guard``): an operator whose
outputs would take the process over the limit is stopped before it allocates them, whatever shape
its arguments come in (single tensors, lists of tensors as ``torch.cat`` takes them); views pass."""

from __future__ import annotations

import gc

import pytest
import torch

from acshim.planner.process import Guard, OverBudget, ProcessMemory

MIB = 2**20

pytestmark = pytest.mark.skipif(not ProcessMemory("cpu").available, reason="needs /proc/self/statm")


def _guard(room: int) -> Guard:
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
