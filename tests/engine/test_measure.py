"""measure_memory: honest bytes held for backward, checked against hand-computed figures."""

from __future__ import annotations

import torch
from torch import nn

import acshim


def test_mlp_matches_hand_computed_figure() -> None:
    torch.manual_seed(0)
    fc1, relu, fc2 = nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)
    model = nn.Sequential(fc1, relu, fc2)
    batch = 4
    report = acshim.measure_memory(model, torch.randn(batch, 16), loss_fn=lambda out: out.sum(),
                                   blocks=list(model.named_children()))
    # fc1 saves its input (the step's input: excluded) and weight (a parameter: excluded); its output is
    # consumed by ReLU, which saves only its result; fc2 saves that same result (counted once); sum()
    # saves nothing; the scalar loss is held by the caller.
    relu_out = batch * 32 * 4
    loss = 4
    assert report.per_block == {"0": 0, "1": relu_out, "2": 0, "<other>": loss}
    assert report.held_bytes == relu_out + loss


def test_tensors_held_by_a_closure_are_counted() -> None:
    stash: list[torch.Tensor] = []

    class Stashing(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            stash.append(x * 2)  # kept outside autograd
            return x.sum()

    report = acshim.measure_memory(Stashing(), torch.randn(10, 10), loss_fn=lambda out: out, backward=False)
    assert report.held_bytes == 10 * 10 * 4 + 4


def test_shared_storage_counted_once() -> None:
    class Views(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x.exp()  # exp saves its result
            return (y[:5].exp() + y[5:].exp()).sum() + y.view(-1).exp().sum()  # views of y saved again

    report = acshim.measure_memory(Views(), torch.randn(10, 4, requires_grad=True), loss_fn=lambda out: out)
    y_bytes = 40 * 4
    views_exp = 20 * 4 + 20 * 4 + 40 * 4  # each .exp() of a view saves its own result
    assert report.held_bytes == y_bytes + views_exp + 4


def test_checkpointing_drops_held_memory_to_block_outputs() -> None:
    torch.manual_seed(0)
    model = acshim.testing.tiny_sequential(4, 32)
    x = torch.randn(16, 32)
    before = acshim.measure_memory(model, x)
    acshim.apply_checkpointing(model)
    after = acshim.measure_memory(model, x)
    block_output = 16 * 32 * 4
    # each block's output is kept as the next region's input; the last one only feeds sum(), which keeps nothing
    assert after.per_block == {"0": block_output, "1": block_output, "2": block_output, "3": 0, "<other>": 4}
    assert before.held_bytes > 5 * after.held_bytes
