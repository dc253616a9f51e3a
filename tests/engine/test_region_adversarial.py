"""Regions under unusual use: frozen modules that still reach trainable tensors, second backwards.

Each case compares against the same computation without checkpointing (bitwise on CPU)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import acshim

MODES = [pytest.param(True, id="reentrant"), pytest.param(False, id="non_reentrant")]


class FrozenCallsAdapter(nn.Module):
    """A frozen module whose forward runs a trainable module handed to it as an argument."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(6, 6)
        self.dropout = nn.Dropout(0.3)
        self.requires_grad_(False)

    def forward(self, x: torch.Tensor, adapter: nn.Module) -> torch.Tensor:
        return self.dropout(self.base(x) + adapter(x)).tanh()


class ViewWeights(nn.Module):
    """Weights held as plain tensor views of a parent's flat parameter (FairScale's
    FlattenParamsWrapper layout): the module itself has no parameter at all."""

    def __init__(self, flat: nn.Parameter) -> None:
        super().__init__()
        self.flat = [flat]  # not registered: only the views are used, as FlattenParamsWrapper does
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        weight = self.flat[0][:36].view(6, 6)
        bias = self.flat[0][36:]
        return torch.nn.functional.linear(x, weight, bias).relu()


def assert_bitwise_equal(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected):
        assert got is not None and torch.equal(got, want), (got, want)


def _grads(*modules: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for m in modules for p in m.parameters() if p.grad is not None]


@pytest.mark.parametrize("reentrant", MODES)
def test_frozen_module_with_trainable_module_argument_gets_gradients(reentrant: bool) -> None:
    torch.manual_seed(0)
    frozen, adapter = FrozenCallsAdapter(), nn.Linear(6, 6)
    x = torch.randn(4, 6)

    torch.manual_seed(1)
    frozen(x, adapter).sum().backward()
    expected = _grads(adapter)
    adapter.zero_grad(set_to_none=True)

    torch.manual_seed(1)
    acshim.checkpoint(frozen, x, adapter, use_reentrant=reentrant).sum().backward()
    assert len(expected) == 2
    assert_bitwise_equal(_grads(adapter), expected)


@pytest.mark.parametrize("reentrant", MODES)
def test_parameterless_module_over_flat_parameter_views_gets_gradients(reentrant: bool) -> None:
    torch.manual_seed(0)
    flat = nn.Parameter(torch.randn(42))
    module = ViewWeights(flat)
    x = torch.randn(3, 6)

    module(x).sum().backward()
    expected = flat.grad.clone()
    flat.grad = None

    out = acshim.run_region(module, (x,), {}, acshim.RegionOptions(reentrant=reentrant))
    assert out.requires_grad
    out.sum().backward()
    assert_bitwise_equal([flat.grad], [expected])


def test_fairscale_flatten_params_wrapper_over_checkpoint_wrapper_gets_gradients() -> None:
    """FairScale's own test_checkpoint_requires_grad layout: FlattenParamsWrapper(checkpoint_wrapper(m))."""
    fairscale_misc = pytest.importorskip("fairscale.nn.misc")
    from acshim.facades.fairscale.nn.checkpoint import checkpoint_wrapper

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 2))

    x = torch.randn(4, 6)
    reference = build()
    reference(x).sum().backward()
    expected = torch.cat([p.grad.flatten() for p in reference.parameters()])

    wrapped = fairscale_misc.FlattenParamsWrapper(checkpoint_wrapper(build()))
    wrapped(x).sum().backward()
    (flat,) = [p for p in wrapped.parameters() if p.requires_grad]
    assert flat.grad is not None
    assert_bitwise_equal([flat.grad], [expected])


def test_truly_frozen_region_stays_cheap_no_saved_inputs_no_recompute() -> None:
    """The safe shortcut: a probe proves no output needs a gradient, so the region keeps nothing
    for backward and is never recomputed."""
    torch.manual_seed(0)
    frozen = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    frozen.requires_grad_(False)
    head = nn.Linear(8, 1)
    x = torch.randn(5, 8)
    packed: list[torch.Size] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(t.shape)
        return t

    recomputes = acshim.region.STATS.recomputes
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        features = acshim.run_region(frozen, (x,), {}, acshim.RegionOptions(reentrant=True))
    assert not features.requires_grad
    assert packed == []  # nothing of the frozen region is held for backward
    head(features).sum().backward()
    assert acshim.region.STATS.recomputes == recomputes
    assert head.weight.grad is not None


@pytest.mark.parametrize("reentrant", MODES)
def test_second_backward_with_retained_graph_accumulates_like_torch(reentrant: bool) -> None:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(5, 5), nn.Dropout(0.2), nn.Tanh())
    x = torch.randn(3, 5, requires_grad=True)

    torch.manual_seed(7)
    loss = block(x).pow(2).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    expected = [x.grad.clone(), *_grads(block)]
    x.grad = None
    block.zero_grad(set_to_none=True)

    torch.manual_seed(7)
    loss = acshim.checkpoint(block, x, use_reentrant=reentrant).pow(2).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    assert_bitwise_equal([x.grad, *_grads(block)], expected)


def test_second_backward_without_retained_graph_raises_torchs_error() -> None:
    x = torch.randn(3, requires_grad=True)
    loss = acshim.checkpoint(torch.nn.Linear(3, 3), x, use_reentrant=True).sum()
    loss.backward()
    with pytest.raises(RuntimeError, match="Trying to backward through the graph a second time"):
        loss.backward()


def test_a_region_that_raises_leaves_no_dispatch_mode_or_saved_tensor_hook_behind(monkeypatch):
    """Torch before 2.13 (2.11, seen on an H100) does not close its checkpoint generator when the
    function raises: the selective-checkpoint mode and the saved-tensor hooks stayed entered, and the
    next plain forward ran under them. Simulated here by torch's own generator driven the old way."""
    import torch.utils.checkpoint as torch_checkpoint
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    import acshim.region

    def old_checkpoint(function, *args, use_reentrant, preserve_rng_state=True, context_fn=None,
                       determinism_check="default", debug=False, early_stop=True, **kwargs):
        gen = torch_checkpoint._checkpoint_without_reentrant_generator(
            function, preserve_rng_state, context_fn, determinism_check, debug, early_stop, *args, **kwargs)
        next(gen)
        ret = function(*args, **kwargs)  # an exception leaves gen suspended inside its contexts
        next(gen, None)
        return ret

    monkeypatch.setattr(acshim.region, "TORCH_CHECKPOINT", old_checkpoint)

    def failing(x):
        x.sin()  # runs under the selective-checkpoint mode, then the error
        raise KeyError("user error inside the region")

    context = lambda: create_selective_checkpoint_contexts(lambda *a, **k: CheckpointPolicy.MUST_SAVE)  # noqa: E731
    x = torch.randn(8, requires_grad=True)
    with pytest.raises(KeyError) as caught:  # kept, as a caller that logs or re-raises it later keeps it
        acshim.checkpoint(failing, x, use_reentrant=False, context_fn=context)
    assert torch._C._len_torch_dispatch_stack() == 0
    (x * x).sum().backward()  # a leaked checkpoint pack hook would take these saved tensors
    assert torch.equal(x.grad, 2 * x.detach())
    assert caught.traceback  # the traceback lived through the plain step
