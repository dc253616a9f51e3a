"""functorch transforms and regions (issue 28 item 3).

- ``torch.vmap`` inside a region: torch's checkpoint and the plain call work, and so does acshim's,
  bitwise (a reentrant region's parameter aliases, made in its recompute, were made inside the
  transform: functorch's "You are attempting to call Tensor.requires_grad_()" error);
- a transform over a region (``torch.func.grad``, ``vmap``, ``jvp``): where acshim cannot run it
  exactly it raises torch's own error for the same call of torch's checkpoint, never another one
  (vmap and jvp over a reentrant region returned values whose backward then failed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import acshim
from acshim.testing import assert_bitwise_equal


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Dropout(0.25), nn.Linear(8, 6))


def _step(region: Callable[..., Any] | None, reentrant: bool) -> dict[str, torch.Tensor]:
    model = _model()
    x = torch.randn(5, 3, 6, requires_grad=True)

    def body(t: torch.Tensor) -> torch.Tensor:  # vmap over the batch, inside the region
        return torch.vmap(model, randomness="same")(t).sin()

    torch.manual_seed(1)
    out = body(x) if region is None else region(body, x, use_reentrant=reentrant)
    out.square().mean().backward()
    return {"grad:x": x.grad, **{f"grad:{n}": p.grad for n, p in model.named_parameters()}}


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_vmap_inside_a_region_is_bitwise_the_plain_call(reentrant: bool) -> None:
    plain = _step(None, reentrant)
    assert_bitwise_equal(plain, _step(acshim.checkpoint, reentrant))
    assert_bitwise_equal(plain, _step(torch_checkpoint.checkpoint, reentrant))  # torch's agrees


def _over(transform: str, region: Callable[..., Any], reentrant: bool) -> Any:
    model = _model().eval()
    x = torch.randn(4, 6)

    def f(t: torch.Tensor) -> torch.Tensor:
        return region(model, t, use_reentrant=reentrant)

    if transform == "grad":
        return torch.func.grad(lambda t: f(t).sum())(x)
    if transform == "vmap":
        return torch.vmap(f)(x)
    if transform == "jvp":
        return torch.func.jvp(f, (x,), (torch.ones_like(x),))
    return torch.func.jacrev(f)(x[0])


@pytest.mark.parametrize("transform", ["grad", "vmap", "jvp", "jacrev"])
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_a_transform_over_a_region_behaves_as_over_torchs_checkpoint(transform: str, reentrant: bool) -> None:
    try:
        expected = _over(transform, torch_checkpoint.checkpoint, reentrant)
    except Exception as error:
        with pytest.raises(type(error)) as raised:
            _over(transform, acshim.checkpoint, reentrant)
        assert str(raised.value) == str(error)
        return
    actual = _over(transform, acshim.checkpoint, reentrant)
    for want, got in zip(torch.utils._pytree.tree_leaves(expected), torch.utils._pytree.tree_leaves(actual),
                         strict=True):
        assert torch.equal(want, got)


def test_grad_over_a_reentrant_region_raises_functorchs_autograd_function_error() -> None:
    """The exact case the issue names: torch's message, not acshim's saved-tensor-hooks one."""
    with pytest.raises(RuntimeError, match="In order to use an autograd.Function with functorch transforms"):
        _over("grad", acshim.checkpoint, True)
