"""PyTorch-native facade: checkpoint_wrapper / offload_wrapper / apply_activation_checkpointing.

Encodes what PyTorch's own test (test/distributed/fsdp/test_checkpoint_wrapper.py) checks, plus
bitwise gradients and held memory against torch's real wrappers (torch is always installed).
"""

from __future__ import annotations

import copy
import functools
import pickle
import warnings

import pytest
import torch
import torch.distributed.algorithms._checkpoint.checkpoint_wrapper as torch_wrapper
from torch import nn
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import acshim
import acshim.facades.torch.distributed as torch_facade_root
from acshim.facades.torch.distributed.algorithms._checkpoint import checkpoint_wrapper as facade
from acshim.facades.torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    _CHECKPOINT_PREFIX,
    _CHECKPOINT_WRAPPED_MODULE,
    ActivationWrapper,
    CheckpointImpl,
    CheckpointWrapper,
    OffloadWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
    offload_wrapper,
)
from acshim.measure import measure_memory
from acshim.testing import MLPBlock, assert_bitwise_equal, seeded, tiny_sequential, train_step

IMPLS = [CheckpointImpl.REENTRANT, CheckpointImpl.NO_REENTRANT]


def unprefixed(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A step state with the wrapper's FQN segment removed (root ``named_parameters`` keeps it, as upstream)."""
    return {key.replace(_CHECKPOINT_PREFIX, ""): value for key, value in state.items()}


def wrap_blocks(model: nn.Module, wrapper_fn) -> nn.Module:
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper_fn, check_fn=lambda m: isinstance(m, MLPBlock))
    return model


@pytest.fixture(autouse=True)
def quiet_future_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, message="Please specify CheckpointImpl")
        yield


@pytest.mark.parametrize("impl", IMPLS, ids=lambda i: i.name)
def test_gradients_bitwise_equal_to_plain_and_to_torch_wrapper(impl):
    inputs = torch.randn(2, 8, 64, requires_grad=True)  # torch's REENTRANT needs an input requiring grad
    expected = train_step(seeded(tiny_sequential), inputs)
    ours = train_step(wrap_blocks(seeded(tiny_sequential), functools.partial(checkpoint_wrapper, checkpoint_impl=impl)),
                      inputs)
    upstream_model = seeded(tiny_sequential)
    torch_wrapper.apply_activation_checkpointing(
        upstream_model, checkpoint_wrapper_fn=functools.partial(torch_wrapper.checkpoint_wrapper, checkpoint_impl=impl),
        check_fn=lambda m: isinstance(m, MLPBlock))
    upstream = train_step(upstream_model, inputs)
    assert_bitwise_equal(expected, unprefixed(ours))
    assert_bitwise_equal(upstream, ours)


@pytest.mark.parametrize("impl", IMPLS, ids=lambda i: i.name)
def test_held_memory_not_higher_than_torch_wrapper(impl):
    inputs = torch.randn(2, 16, 64, requires_grad=True)
    ours = wrap_blocks(seeded(tiny_sequential), functools.partial(checkpoint_wrapper, checkpoint_impl=impl))
    upstream = seeded(tiny_sequential)
    torch_wrapper.apply_activation_checkpointing(
        upstream, checkpoint_wrapper_fn=functools.partial(torch_wrapper.checkpoint_wrapper, checkpoint_impl=impl),
        check_fn=lambda m: isinstance(m, MLPBlock))
    plain = measure_memory(seeded(tiny_sequential), inputs).held_bytes
    assert measure_memory(ours, inputs).held_bytes <= measure_memory(upstream, inputs).held_bytes < plain


def test_reentrant_gives_parameter_gradients_when_no_input_requires_grad():
    # torch's reentrant wrapper fails here ("element 0 of tensors does not require grad").
    inputs = torch.randn(2, 8, 64)
    expected = train_step(seeded(tiny_sequential), inputs)
    model = wrap_blocks(seeded(tiny_sequential), functools.partial(checkpoint_wrapper,
                                                                   checkpoint_impl=CheckpointImpl.REENTRANT))
    assert_bitwise_equal(expected, unprefixed(train_step(model, inputs)))


def test_default_checkpoint_fn_runs_on_the_engine():
    seen = []

    class Probe(nn.Linear):
        def forward(self, x):
            seen.append(acshim.is_recomputing())
            return super().forward(x)

    for impl in IMPLS:
        seen.clear()
        wrapped = checkpoint_wrapper(Probe(2, 2), checkpoint_impl=impl)
        assert wrapped.checkpoint_fn.func is acshim.checkpoint
        wrapped(torch.rand(3, 2, requires_grad=True)).sum().backward()
        assert seen == [False, True]


def test_checkpoint_keywords_map_to_engine_options_and_errors():
    x = torch.rand(3, 2, requires_grad=True)
    no_rng = checkpoint_wrapper(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5)), preserve_rng_state=False,
                                determinism_check="none", debug=False, early_stop=False)
    no_rng(x).sum().backward()
    with pytest.raises(ValueError, match="determinism_check should be one of"):
        checkpoint_wrapper(nn.Linear(2, 2), determinism_check="strict")(x)
    with pytest.raises(ValueError, match="Passing context_fn or debug is only supported when use_reentrant=False"):
        checkpoint_wrapper(nn.Linear(2, 2), checkpoint_impl=CheckpointImpl.REENTRANT, debug=True)(x)


def test_selective_context_fn_keeps_gradients_bitwise_equal():
    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.addmm.default else CheckpointPolicy.PREFER_RECOMPUTE

    inputs = torch.randn(2, 8, 64)
    expected = train_step(seeded(tiny_sequential), inputs)
    wrapper_fn = functools.partial(checkpoint_wrapper, context_fn=functools.partial(create_selective_checkpoint_contexts,
                                                                                    policy))
    assert_bitwise_equal(expected, unprefixed(train_step(wrap_blocks(seeded(tiny_sequential), wrapper_fn), inputs)))


def test_user_checkpoint_fn_is_honoured_with_kwargs_packed_for_reentrant():
    calls = []

    def my_checkpoint(function, *args, **kwargs):
        calls.append((len(args), sorted(kwargs)))
        return torch.utils.checkpoint.checkpoint(function, *args, **kwargs)

    class TwoInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(2, 2)

        def forward(self, a, b=None):
            return self.linear(a) + self.linear(b)

    x = torch.rand(3, 2, requires_grad=True)
    wrapped = checkpoint_wrapper(TwoInputs(), CheckpointImpl.REENTRANT, my_checkpoint, use_reentrant=True)
    wrapped(x, b=x).sum().backward()
    assert calls == [(2, ["use_reentrant"])]  # b packed into the positional inputs
    calls.clear()
    wrapped = checkpoint_wrapper(TwoInputs(), CheckpointImpl.NO_REENTRANT, my_checkpoint, use_reentrant=False)
    wrapped(x, b=x).sum().backward()
    assert calls == [(1, ["b", "use_reentrant"])]


def test_kwarg_support_for_both_impls_and_offload():
    # PyTorch's test_checkpoint_wrapper_kwarg_support.
    class FourOut(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(10, 10)

        def forward(self, a, b, c=None, d=None, **kwargs):
            return (self.lin(a), self.lin(b), self.lin(c), self.lin(d))

    class KeywordOnly(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(10, 10)

        def forward(self, *, a=None, b=None):
            return (self.lin(a), self.lin(b))

    for wrapper in [functools.partial(checkpoint_wrapper, checkpoint_impl=impl) for impl in IMPLS] + [offload_wrapper]:
        model = wrapper(FourOut())
        assert isinstance(model, OffloadWrapper if wrapper is offload_wrapper else CheckpointWrapper)
        inp = torch.ones(4, 10, requires_grad=True)
        out = model(inp, inp, c=inp, d=inp, e=inp, f=inp)
        out_positional = model(inp, inp, inp, inp)
        assert isinstance(out, tuple) and len(out) == 4
        for with_kwargs, positional in zip(out, out_positional):
            assert torch.equal(with_kwargs, positional) and with_kwargs.requires_grad == positional.requires_grad
    model = checkpoint_wrapper(KeywordOnly(), checkpoint_impl=CheckpointImpl.REENTRANT)
    inp = torch.ones(4, 10, requires_grad=True)
    assert len(model(a=inp, b=inp)) == 2


def test_state_dict_loads_into_unwrapped_and_back():
    # PyTorch's test_load_activation_checkpointed_module and test_fqn.
    lin = checkpoint_wrapper(nn.Linear(10, 10, bias=False), checkpoint_fn=torch.utils.checkpoint.checkpoint,
                             use_reentrant=True, preserve_rng_state=False)
    assert list(lin.state_dict()) == ["weight"]
    assert [name for name, _ in lin.named_parameters()] == ["weight"]
    plain = nn.Linear(10, 10, bias=False)
    plain.load_state_dict(copy.deepcopy(lin.state_dict()))
    assert torch.equal(plain.weight, lin._checkpoint_wrapped_module.weight)
    with torch.no_grad():
        plain.weight.add_(0.5)
    lin.load_state_dict(copy.deepcopy(plain.state_dict()))
    assert torch.equal(plain.weight, lin._checkpoint_wrapped_module.weight)
    assert [name for name, _ in lin.named_modules()] == ["", _CHECKPOINT_WRAPPED_MODULE]


def test_attribute_and_index_access_forward_to_wrapped_module():
    # PyTorch's test_forward_missing_attributes.
    lin = nn.Linear(1, 1)
    inner = nn.Sequential(lin, lin)
    wrapped = CheckpointWrapper(inner)
    assert wrapped[0] is lin
    inner._foo = "bar"
    assert wrapped._foo == "bar"


def test_apply_activation_checkpointing_wraps_nested_matches_and_never_the_root():
    # PyTorch's test_apply_activation_checkpointing: nested Linear inside a Sequential gets wrapped too.
    class LinearWithBatchNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(10, 10)
            self.bn = nn.BatchNorm1d(10)
            self.nested_linear = nn.Sequential(nn.Linear(10, 10))

        def forward(self, x):
            return self.bn(self.nested_linear(self.lin(x)))

    for wrapper in [functools.partial(checkpoint_wrapper, checkpoint_impl=impl) for impl in IMPLS] + [offload_wrapper]:
        model = nn.Sequential(LinearWithBatchNorm(), LinearWithBatchNorm(), LinearWithBatchNorm())
        assert apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper,
                                              check_fn=lambda m: isinstance(m, nn.Linear)) is None
        wrappers = [m for m in model.modules() if isinstance(m, ActivationWrapper)]
        assert len(wrappers) == 6 == sum(isinstance(m, nn.Linear) for m in model.modules())
        inp = torch.randn(4, 10, requires_grad=True)
        for _ in range(3):
            model(inp).sum().backward()
        for block in model:
            for linear in (block.lin, block.nested_linear[0]):
                assert isinstance(linear, (CheckpointWrapper, OffloadWrapper))
                assert linear._checkpoint_wrapped_module.weight.grad is not None

    model = nn.Sequential(nn.Linear(2, 2))
    apply_activation_checkpointing(model, check_fn=lambda m: True)
    assert type(model) is nn.Sequential and isinstance(model[0], CheckpointWrapper)


def test_auto_wrap_policy_wins_over_check_fn_and_bad_policy_is_rejected():
    model = seeded(tiny_sequential)
    apply_activation_checkpointing(model, check_fn=lambda m: False, auto_wrap_policy=ModuleWrapPolicy({MLPBlock}))
    assert all(isinstance(block, CheckpointWrapper) for block in model)
    model = seeded(tiny_sequential)
    apply_activation_checkpointing(model, auto_wrap_policy=lambda module, recurse, nonwrapped_numel: recurse or
                                   isinstance(module, nn.LayerNorm))
    assert all(isinstance(block.norm, CheckpointWrapper) for block in model)
    with pytest.raises(ValueError, match="to be callable or be a pre-defined wrap policy"):
        apply_activation_checkpointing(seeded(tiny_sequential), auto_wrap_policy=42)


def test_reentrant_wrapper_warns_future_warning_with_torch_text():
    with pytest.warns(FutureWarning, match="Please specify CheckpointImpl.NO_REENTRANT as CheckpointImpl.REENTRANT "
                                           "will soon be removed"):
        checkpoint_wrapper(nn.Linear(2, 2), checkpoint_impl=CheckpointImpl.REENTRANT)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        checkpoint_wrapper(nn.Linear(2, 2))


def test_facade_classes_are_torch_classes_and_share_the_enum():
    wrapped = checkpoint_wrapper(nn.Linear(2, 2))
    assert isinstance(wrapped, torch_wrapper.CheckpointWrapper)
    assert isinstance(offload_wrapper(nn.Linear(2, 2)), torch_wrapper.OffloadWrapper)
    assert CheckpointImpl is torch_wrapper.CheckpointImpl
    assert (_CHECKPOINT_WRAPPED_MODULE, _CHECKPOINT_PREFIX) == ("_checkpoint_wrapped_module", "_checkpoint_wrapped_module.")


def test_torch_functions_build_facade_classes_once_the_class_is_patched(monkeypatch):
    # What `acshim run` does: torch's module holds the facade classes, so torch's own
    # checkpoint_wrapper (bound earlier, e.g. as apply_activation_checkpointing's default) builds ours.
    monkeypatch.setattr(torch_wrapper, "CheckpointWrapper", CheckpointWrapper)
    model = seeded(tiny_sequential)
    torch_wrapper.apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, MLPBlock))
    assert all(type(block) is CheckpointWrapper for block in model)
    assert model[0].checkpoint_fn.func is acshim.checkpoint


def test_wrapped_model_deep_copies_and_pickles():
    inputs = torch.randn(2, 8, 64)
    model = wrap_blocks(seeded(tiny_sequential), checkpoint_wrapper)
    expected = train_step(model, inputs)
    assert_bitwise_equal(expected, train_step(copy.deepcopy(model), inputs))
    assert_bitwise_equal(expected, train_step(pickle.loads(pickle.dumps(model)), inputs))


def test_offload_wrapper_keeps_gradients_and_holds_no_more_than_plain_on_cpu():
    # torch's offload_wrapper copies every saved CPU tensor (save_on_cpu(pin_memory=True)): ~1.4x here.
    inputs = torch.randn(2, 16, 64)
    expected = train_step(seeded(tiny_sequential), inputs)
    assert_bitwise_equal(expected, unprefixed(train_step(offload_wrapper(seeded(tiny_sequential)), inputs)))
    plain = measure_memory(seeded(tiny_sequential), inputs).held_bytes
    ours = measure_memory(offload_wrapper(seeded(tiny_sequential)), inputs).held_bytes
    upstream = measure_memory(torch_wrapper.offload_wrapper(seeded(tiny_sequential)), inputs).held_bytes
    assert ours <= plain < upstream


def test_offload_wrapper_follows_engine_defaults_and_really_moves_tensors():
    # SMP v2's torch.sagemaker.init sets these defaults; the disk tier moves even CPU tensors.
    storage = pytest.importorskip("acshim.storage")
    inputs = torch.randn(2, 8, 64)
    expected = train_step(seeded(tiny_sequential), inputs)
    previous = storage.set_defaults(storage="disk", prefetch=1)
    try:
        with storage.recording() as sessions:
            actual = train_step(offload_wrapper(seeded(tiny_sequential)), inputs)
    finally:
        storage.set_defaults(**vars(previous))
    assert [(s.stats.storage, s.stats.prefetch) for s in sessions] == [("disk", 1)]
    assert sessions[0].stats.moved > 0 and sessions[0].stats.fetched > 0
    assert_bitwise_equal(expected, unprefixed(actual))


def test_offload_wrapper_composes_with_checkpoint_wrapper():
    inputs = torch.randn(2, 8, 64)
    expected = train_step(seeded(tiny_sequential), inputs)
    model = wrap_blocks(seeded(tiny_sequential), lambda m: offload_wrapper(checkpoint_wrapper(m)))
    assert_bitwise_equal(expected, unprefixed(train_step(model, inputs)))


def test_pre_2_1_offload_to_cpu_keyword_is_accepted_instead_of_reaching_forward():
    inputs = torch.randn(2, 8, 64)
    expected = train_step(seeded(tiny_sequential), inputs)
    model = wrap_blocks(seeded(tiny_sequential), functools.partial(checkpoint_wrapper, offload_to_cpu=True))
    assert_bitwise_equal(expected, unprefixed(train_step(model, inputs)))
    storage = pytest.importorskip("acshim.storage")
    with storage.recording() as sessions:
        wrapped = checkpoint_wrapper(nn.Linear(2, 2), offload_to_cpu=True)
        wrapped(torch.rand(1, 2, requires_grad=True)).sum().backward()
    assert [(s.stats.storage, s.stats.saved) for s in sessions] == [("host", 1)]
    with pytest.raises(TypeError, match="offload_to_cpu"):  # torch 2.1+ forwards it into forward()
        torch_wrapper.checkpoint_wrapper(nn.Linear(2, 2), offload_to_cpu=True)(torch.rand(1, 2, requires_grad=True))


def test_acshim_patches_name_torch_entry_points_and_facade_objects():
    import pkgutil

    from acshim.patching.dialects import dialect_named

    root = pkgutil.resolve_name(dialect_named("torch").facade)
    assert root.ACSHIM_PATCHES is torch_facade_root.ACSHIM_PATCHES
    names = {attribute for _, attribute, _ in root.ACSHIM_PATCHES}
    assert names == {"CheckpointWrapper", "OffloadWrapper", "checkpoint_wrapper", "offload_wrapper",
                     "apply_activation_checkpointing"}
    for upstream_module, attribute, facade_path in root.ACSHIM_PATCHES:
        assert upstream_module == torch_wrapper.__name__ and hasattr(torch_wrapper, attribute)
        assert pkgutil.resolve_name(facade_path) is getattr(facade, attribute)
