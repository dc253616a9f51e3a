"""``acshim.discard.DiscardedOutputRegion`` (Megatron's ``CheckpointWithoutOutput`` semantics): the
output's storage is freed after its consumer saved it and rebuilt when the hook tensor's gradient
arrives; gradients bitwise equal to the plain call with dropout on, less memory held for backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from acshim.discard import DiscardedOutputRegion
from acshim.region import run_region


class Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.calls = nn.LayerNorm(64), 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return nn.functional.dropout(self.norm(x), 0.3)


def _models() -> tuple[Norm, nn.Linear]:
    torch.manual_seed(0)
    return Norm(), nn.Linear(64, 64)


def _held_bytes(saved: list[torch.Tensor]) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    return sum(storages.values())


def _step(norm: Norm, linear: nn.Linear, mode: str) -> tuple[list[torch.Tensor], int]:
    torch.manual_seed(1)
    x = torch.randn(32, 64, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        if mode == "plain":
            out = linear(norm(x))
        elif mode == "region":
            out = linear(run_region(norm, (x,)))
        else:
            region = DiscardedOutputRegion()
            out = linear(region.run(norm, x))
            if mode == "discard":
                region.discard(out)
    held = _held_bytes(saved)
    out.pow(2).sum().backward()
    return [x.grad, *(p.grad for p in (*norm.parameters(), *linear.parameters()))], held


@pytest.mark.parametrize("mode", ["discard", "no-discard"])
def test_discarded_output_is_rebuilt_bitwise_with_dropout(mode: str) -> None:
    expected, _ = _step(*_models(), "plain")
    norm, linear = _models()
    grads, _ = _step(norm, linear, mode)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected, strict=True))
    assert norm.calls == 2  # forward and one recompute (in the hook, or in backward without discard)


def test_discarding_holds_less_for_backward_than_a_plain_region() -> None:
    _, region_held = _step(*_models(), "region")
    _, discard_held = _step(*_models(), "discard")
    norm_output = 32 * 64 * 4
    assert discard_held <= region_held - norm_output


def test_autograd_grad_raises_the_checkpoint_error() -> None:
    norm, linear = _models()
    x = torch.randn(4, 64, requires_grad=True)
    region = DiscardedOutputRegion()
    out = linear(region.run(norm, x))
    region.discard(out)
    with pytest.raises(RuntimeError, match="Checkpointing is not compatible with .grad"):
        torch.autograd.grad(out.sum(), [x])


def test_without_grad_it_is_a_plain_call() -> None:
    norm, _ = _models()
    with torch.no_grad():
        output = DiscardedOutputRegion().run(norm, torch.randn(2, 64))
    assert output.grad_fn is None and norm.calls == 1


