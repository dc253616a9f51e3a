"""Selective-op checkpointing: saved operators are not recomputed, gradients stay exact."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import acshim
from acshim.selective import resolve_op, save_ops
from acshim.testing import GPT, assert_bitwise_equal, seeded, train_step


def _loss(output: torch.Tensor) -> torch.Tensor:
    return output


def test_saving_matmuls_is_exact_and_holds_between_full_and_none() -> None:
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    plain = train_step(seeded(GPT), ids, loss_fn=_loss)
    held = {"none": acshim.measure_memory(seeded(GPT), ids, loss_fn=_loss).held_bytes}
    for name, changes in (("full", {}), ("selective", {"context_fn": save_ops()})):
        model = seeded(GPT)
        acshim.apply_checkpointing(model, **changes)
        assert_bitwise_equal(plain, train_step(model, ids, loss_fn=_loss))
        model = seeded(GPT)
        acshim.apply_checkpointing(model, **changes)
        held[name] = acshim.measure_memory(model, ids, loss_fn=_loss).held_bytes
    assert held["full"] < held["selective"] < held["none"]


class ThreeMatmuls(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(16, 16, bias=False) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in (self.a, self.b, self.c):
            x = torch.tanh(layer(x))
        return x


class Checkpointed(nn.Module):
    def __init__(self, inner: nn.Module, context_fn) -> None:
        super().__init__()
        self.inner, self.context_fn = inner, context_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return acshim.checkpoint(self.inner, x, context_fn=self.context_fn)


def test_every_other_matmul_is_recomputed() -> None:
    x = torch.randn(8, 16)
    plain = train_step(seeded(ThreeMatmuls), x)
    held = {}
    for rule, alternate in (("all", []), ("alternate", ["aten.mm.default"])):
        model = Checkpointed(seeded(ThreeMatmuls), save_ops(["aten.mm.default"], recompute_every_other=alternate))
        held[rule] = acshim.measure_memory(model, x, loss_fn=lambda out: out.sum(), backward=False).held_bytes
        step = train_step(model, x)
        assert_bitwise_equal(plain, {k.replace("inner.", ""): v for k, v in step.items()})
    mm_output = 8 * 16 * 4
    assert held["all"] - held["alternate"] == mm_output  # the 2nd of 3 matmuls is no longer kept


def test_policy_alternates_forward_and_recompute_counts() -> None:
    from acshim.selective import _SaveOpsPolicy

    mm = torch.ops.aten.mm.default
    policy = _SaveOpsPolicy(frozenset({mm}), frozenset({mm}))

    class Ctx:
        is_recompute = False

    decisions = [policy(Ctx(), mm) for _ in range(3)]
    Policy = torch.utils.checkpoint.CheckpointPolicy
    assert decisions == [Policy.MUST_SAVE, Policy.PREFER_RECOMPUTE, Policy.MUST_SAVE]
    Ctx.is_recompute = True
    assert [policy(Ctx(), mm) for _ in range(3)] == decisions  # recompute counts separately


def test_bad_operator_names_are_rejected() -> None:
    with pytest.raises(ValueError, match="name one overload, e.g. aten.mm.default"):
        resolve_op(torch.ops.aten.mm)
    with pytest.raises(ValueError, match="unknown operator 'aten.nope.default'"):
        save_ops(["aten.nope.default"])
    with pytest.raises(ValueError, match="at least one operator"):
        save_ops([])


def _gathering_in_recompute(model: nn.Module, extra) -> nn.Module:
    """``model`` whose linear layers run ``extra`` before their forward in every call but the first:
    as DeepSpeed ZeRO-3's and FSDP's pre-forward hooks gather in the recompute the parameters the
    forward found prefetched (``torch.cat(..., out=...)``)."""
    calls = []

    def gather(module: nn.Module, args: tuple) -> None:
        calls.append(module)
        if calls.count(module) > 1:  # the recompute
            extra(module)

    for layer in model.modules():
        if isinstance(layer, nn.Linear):
            layer.register_forward_pre_hook(gather)
    return model


def _cat_out(module: nn.Module) -> None:
    shards = module.weight.detach().chunk(2)
    torch.cat(shards, out=torch.empty_like(module.weight))


def _matmul(module: nn.Module) -> None:
    torch.mm(module.weight.detach(), module.weight.detach())


class TorchCheckpointed(Checkpointed):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False, context_fn=self.context_fn)


def test_ops_only_the_recompute_runs_are_recomputed_where_torch_sac_raises() -> None:
    """An operator the recompute runs and the forward did not (a parameter gather) is run, as plain
    recompute runs it, gradients bitwise; torch's own selective checkpoint raises on it (torch 2.13
    keeps one entry per op call). An extra call of a saved operator keeps torch's error."""
    import functools

    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    x = torch.randn(8, 16)
    plain = train_step(seeded(ThreeMatmuls), x)
    model = _gathering_in_recompute(Checkpointed(seeded(ThreeMatmuls), save_ops(["aten.mm.default"])), _cat_out)
    step = train_step(model, x)
    assert_bitwise_equal(plain, {k.replace("inner.", ""): v for k, v in step.items()})
    if not hasattr(torch.utils.checkpoint, "_RECOMPUTE"):  # before torch 2.13 only saved outputs are looked up
        return
    torch_sac = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
    model = _gathering_in_recompute(TorchCheckpointed(seeded(ThreeMatmuls), torch_sac), _cat_out)
    with pytest.raises(RuntimeError, match="encountered during backward but not found in storage"):
        train_step(model, x)
    model = _gathering_in_recompute(Checkpointed(seeded(ThreeMatmuls), save_ops(["aten.mm.default"])), _matmul)
    with pytest.raises(RuntimeError, match="aten.mm.default invocation index 3 encountered during backward"):
        train_step(model, x)
