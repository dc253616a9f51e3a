"""``acshim.patching.torch_route``: under ``--budget``/``--report`` the script's own
``torch.utils.checkpoint.checkpoint`` calls reach the engine, with torch's defaults, errors and
compile behaviour; the engine keeps calling torch's own function."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from acshim.patching.torch_route import route_torch_checkpoint, routed_checkpoint, unroute_torch_checkpoint
from acshim.region import STATS, TORCH_CHECKPOINT


@pytest.fixture
def routed() -> Iterator[None]:
    assert route_torch_checkpoint()
    try:
        yield
    finally:
        unroute_torch_checkpoint()
    assert torch_checkpoint.checkpoint is TORCH_CHECKPOINT


def _block() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 16))


def _grads(call, block: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    torch.manual_seed(1)
    block.zero_grad(set_to_none=True)
    call(block, x).square().sum().backward()
    return [p.grad.clone() for p in block.parameters()]


@pytest.mark.parametrize("reentrant", [True, False])
def test_routed_calls_run_on_the_engine_bitwise_equal(routed: None, reentrant: bool) -> None:
    block, x = _block(), torch.randn(4, 16, requires_grad=True)
    expected = _grads(lambda b, t: b(t), block, x)
    before = STATS.forwards, STATS.recomputes
    got = _grads(lambda b, t: torch_checkpoint.checkpoint(b, t, use_reentrant=reentrant), block, x)
    assert (STATS.forwards - before[0], STATS.recomputes - before[1]) == (1, 1)  # the engine ran it
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_default_warns_as_torch_and_means_reentrant(routed: None) -> None:
    block, x = _block(), torch.randn(4, 16, requires_grad=True)
    with pytest.warns(UserWarning, match="the use_reentrant parameter should be passed explicitly") as caught:
        out = torch_checkpoint.checkpoint(block, x)
    assert [w.filename for w in caught if "use_reentrant" in str(w.message)] == [__file__]  # at the caller
    assert type(out.grad_fn).__name__ == "_ReentrantRegionBackward"  # unset means reentrant, as in torch
    with pytest.raises(ValueError, match="Unexpected keyword arguments: scale"):  # torch's error for reentrant
        torch_checkpoint.checkpoint(lambda t, scale: t * scale, x, use_reentrant=True, scale=2)


def test_checkpoint_sequential_segments_are_routed(routed: None) -> None:
    torch.manual_seed(0)
    seq = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)))
    x = torch.randn(3, 8, requires_grad=True)
    before = STATS.forwards
    torch_checkpoint.checkpoint_sequential(seq, 4, x, use_reentrant=False).sum().backward()
    assert STATS.forwards - before == 3  # torch leaves the last segment unchecked


def test_route_is_idempotent_and_undone(routed: None) -> None:
    assert torch_checkpoint.checkpoint is routed_checkpoint
    assert route_torch_checkpoint() is False  # already routed: nothing stacked
    unroute_torch_checkpoint()
    assert torch_checkpoint.checkpoint is TORCH_CHECKPOINT
    assert route_torch_checkpoint()


def test_compiled_call_is_torchs_checkpoint_operator(routed: None) -> None:
    block, x = _block(), torch.randn(4, 16, requires_grad=True)
    block.eval()  # compiled and eager dropout masks differ; the graph is what this checks

    def forward(t: torch.Tensor) -> torch.Tensor:
        return torch_checkpoint.checkpoint(block, t, use_reentrant=False)

    expected = _grads(lambda b, t: b(t), block, x)
    compiled = torch.compile(forward, backend="aot_eager", fullgraph=True)  # fullgraph: no graph break
    before = STATS.forwards
    got = _grads(lambda b, t: compiled(t), block, x)
    assert STATS.forwards == before  # traced as torch's operator, not run by the eager engine
    assert all(torch.allclose(a, b) for a, b in zip(got, expected, strict=True))
