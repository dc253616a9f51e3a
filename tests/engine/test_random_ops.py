"""Random operators in a selective-checkpoint region are recomputed, never replayed from the cache
(``acshim.random_ops``): a saved random operator draws nothing in the recompute, and every random
operator after it then draws what it drew in the forward. Found on an H200, where HF GPT-2's fused
attention with dropout (saved, as the "selective" choice saves attention) shifted the recomputed
dropout masks: gradients off by up to 0.015. Here the same trap is built from CPU operators."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import acshim
from acshim.random_ops import draws_random

aten = torch.ops.aten


def _region(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    noise = torch.rand_like(x)                   # a random operator the policy saves (as a fused attention)
    h = torch.tanh((x + noise) @ weight)
    return F.dropout(h, 0.5, training=True)      # a random operator after it, recomputed


def _save_random_and_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in (aten.rand_like.default, aten.mm.default) else CheckpointPolicy.PREFER_RECOMPUTE


def _grads(run) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)).requires_grad_()
    weight = torch.randn(32, 32, generator=torch.Generator().manual_seed(1)).requires_grad_()
    torch.manual_seed(7)
    run(x, weight).pow(2).sum().backward()
    return x.grad, weight.grad


@pytest.mark.parametrize("how", ["acshim.checkpoint", "torch.utils.checkpoint under acshim.install"])
def test_a_saved_random_operator_leaves_the_later_draws_of_the_recompute_exact(how: str) -> None:
    plain = _grads(_region)

    def context_fn():
        return create_selective_checkpoint_contexts(_save_random_and_matmuls)

    if how == "acshim.checkpoint":
        checkpointed = _grads(lambda x, w: acshim.checkpoint(_region, x, w, use_reentrant=False, context_fn=context_fn))
    else:
        acshim.install()
        try:
            checkpointed = _grads(lambda x, w: torch.utils.checkpoint.checkpoint(_region, x, w, use_reentrant=False,
                                                                               context_fn=context_fn))
        finally:
            acshim.uninstall()
    for got, expected in zip(checkpointed, plain, strict=True):
        assert torch.equal(got, expected)


def test_a_saved_random_operator_with_its_own_generator_is_replayed_exactly() -> None:
    """An operator drawing from a generator the script passes shifts no other draw, and the recompute
    does not restore that generator: the policy's "save" stands, and replaying it is exact (drawn
    again, it would take the generator's next numbers)."""

    def run(x: torch.Tensor, weight: torch.Tensor, checkpointed: bool) -> torch.Tensor:
        generator = torch.Generator().manual_seed(11)

        def region(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            noise = torch.rand(x.shape, generator=generator)
            return F.dropout(torch.tanh((x + noise) @ weight), 0.5, training=True)

        def save_own_draws(ctx, op, *args, **kwargs) -> CheckpointPolicy:
            return CheckpointPolicy.MUST_SAVE if op is aten.rand.generator else CheckpointPolicy.PREFER_RECOMPUTE

        if not checkpointed:
            return region(x, weight)
        return acshim.checkpoint(region, x, weight, use_reentrant=False,
                                 context_fn=lambda: create_selective_checkpoint_contexts(save_own_draws))

    plain = _grads(lambda x, w: run(x, w, False))
    checkpointed = _grads(lambda x, w: run(x, w, True))
    for got, expected in zip(checkpointed, plain, strict=True):
        assert torch.equal(got, expected)


def test_which_operators_draw_random_numbers() -> None:
    q = torch.empty(1, 2, 4, 8, device="meta")
    efficient = aten._scaled_dot_product_efficient_attention.default
    assert draws_random(efficient, (q, q, q, None, True, 0.1), {})
    assert not draws_random(efficient, (q, q, q, None, True, 0.0), {})          # no dropout: saved as before
    assert not draws_random(aten._scaled_dot_product_flash_attention.default, (q, q, q), {"dropout_p": 0.0})
    assert draws_random(aten.native_dropout.default, (q, 0.1, True), {})
    assert not draws_random(aten.native_dropout.default, (q, 0.1, False), {})  # evaluation: the identity
    assert draws_random(aten.bernoulli_.float, (q, 0.5), {})
    assert draws_random(aten.rand_like.default, (q,), {})
    assert not draws_random(aten.rand.generator, ([2, 3],), {"generator": torch.Generator()})  # its own generator
    assert not draws_random(aten.bernoulli.default, (q, torch.Generator()), {})
    assert not draws_random(aten.mm.default, (q, q), {})
