"""FairScale facade: checkpoint_wrapper in place, flags, patch_batchnorm, parity with fairscale 0.4.13.

Encodes what FairScale's own tests (tests/nn/checkpoint/test_checkpoint_activations*.py) check,
plus bitwise gradients and held memory against the real library.
"""

from __future__ import annotations

import copy
import pickle
import threading

import pytest
import torch
from torch import nn

import acshim
import acshim.facades.fairscale as fairscale_facade
from acshim.facades.fairscale.nn.checkpoint import checkpoint_activations as activations
from acshim.facades.fairscale.nn.checkpoint import checkpoint_wrapper, is_checkpointing, is_recomputing
from acshim.facades.fairscale.nn.checkpoint.checkpoint_utils import patch_batchnorm
from acshim.measure import measure_memory
from acshim.testing import ConvBNNet, assert_bitwise_equal, seeded, tiny_sequential, train_step

fairscale = pytest.importorskip("fairscale")
from fairscale.nn.checkpoint import checkpoint_wrapper as upstream_checkpoint_wrapper  # noqa: E402


class Counting(nn.Module):
    """Counts forward calls (FairScale's tests prove a recompute happened, or did not, this way)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.linear = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.linear(x)


def wrap_blocks(model: nn.Sequential, wrapper=checkpoint_wrapper, **kwargs) -> nn.Sequential:
    for block in model:
        wrapper(block, **kwargs)
    return model


def test_checkpoint_wrapper_returns_same_module_with_same_state_dict_keys():
    model = seeded(tiny_sequential)
    keys = list(model.state_dict())
    block = model[0]
    assert checkpoint_wrapper(block) is block
    assert list(model.state_dict()) == keys
    assert [n for n, _ in model.named_modules()] == [n for n, _ in seeded(tiny_sequential).named_modules()]


def test_gradients_bitwise_equal_to_plain_run_with_dropout():
    inputs = torch.randn(2, 8, 64)
    expected = train_step(seeded(tiny_sequential), inputs)
    assert_bitwise_equal(expected, train_step(wrap_blocks(seeded(tiny_sequential)), inputs))


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True")  # fairscale's own warning
def test_parity_with_real_fairscale_gradients_bitwise_and_held_memory_not_higher():
    inputs = torch.randn(2, 16, 64)
    upstream = wrap_blocks(seeded(tiny_sequential), upstream_checkpoint_wrapper)
    facade = wrap_blocks(seeded(tiny_sequential))
    assert_bitwise_equal(train_step(upstream, inputs), train_step(facade, inputs))
    upstream_held = measure_memory(upstream, inputs).held_bytes
    facade_held = measure_memory(facade, inputs).held_bytes
    plain_held = measure_memory(seeded(tiny_sequential), inputs).held_bytes
    assert facade_held <= upstream_held < plain_held


def test_batchnorm_running_stats_updated_once_as_without_checkpointing():
    inputs = torch.randn(4, 3, 8, 8)
    expected = train_step(seeded(ConvBNNet), inputs)
    model = seeded(ConvBNNet)
    for block in model.blocks:
        checkpoint_wrapper(block)
    actual = train_step(model, inputs)
    assert_bitwise_equal(expected, actual)
    assert actual["buffer:blocks.0.1.num_batches_tracked"].item() == 1


def test_keyword_arguments_and_non_tensor_outputs_keep_their_structure():
    class MultiOut(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x, scale=1.0, extra=None):
            return [self.linear(x) * scale, "tag", {"extra": self.linear(extra)}]

    torch.manual_seed(0)
    plain = MultiOut()
    wrapped = checkpoint_wrapper(copy.deepcopy(plain))
    x, extra = torch.randn(2, 4), torch.randn(2, 4, requires_grad=True)
    out_plain = plain(x, scale=2.0, extra=extra)
    out = wrapped(x, scale=2.0, extra=extra)
    # Upstream returns a tuple and cannot return dict values; the structure is kept here.
    assert isinstance(out, list) and out[1] == "tag" and set(out[2]) == {"extra"}
    (out[0].sum() + out[2]["extra"].sum()).backward()
    grad_extra = extra.grad.clone()
    extra.grad = None
    (out_plain[0].sum() + out_plain[2]["extra"].sum()).backward()
    assert torch.equal(grad_extra, extra.grad)
    assert torch.equal(wrapped.linear.weight.grad, plain.linear.weight.grad)


def test_multi_input_multi_output_conv_model_matches_plain():
    # FairScale's test_multiin_multiout: inputs by position and keyword, tuple or summed outputs.
    class TwoConvs(nn.Module):
        def __init__(self, multiout: bool, wrap: int) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.multiout = multiout
            self.conv1 = nn.Sequential(nn.Conv2d(1, 5, 3), nn.ReLU(), nn.Conv2d(5, 5, 3))
            self.conv2 = nn.Sequential(nn.Conv2d(3, 5, 3), nn.ReLU(), nn.Conv2d(5, 5, 3))
            if wrap & 1:
                checkpoint_wrapper(self.conv1)
            if wrap & 2:
                checkpoint_wrapper(self.conv2)

        def forward(self, x1, x2=None):
            out1, out2 = self.conv1(x1), self.conv2(x2)
            return (out1, out2) if self.multiout else out1 + out2

    in1, in2 = torch.rand(2, 1, 12, 12, requires_grad=True), torch.rand(2, 3, 12, 12, requires_grad=True)
    for multiout in (True, False):
        expected = train_step(TwoConvs(multiout, 0), {"x1": in1, "x2": in2})
        for wrap in (1, 2, 3):
            assert_bitwise_equal(expected, train_step(TwoConvs(multiout, wrap), {"x1": in1, "x2": in2}))


def test_frozen_wrapped_modules_are_not_recomputed():
    # fairscale PR #787 / test_checkpoint_requires_grad: frozen = 1 forward, trainable = 2.
    model = nn.Sequential(*[checkpoint_wrapper(Counting()) for _ in range(4)])
    for block in model[:3]:
        block.requires_grad_(False)
    model(torch.rand(4, 2)).sum().backward()
    assert [block.calls for block in model] == [1, 1, 1, 2]

    model = nn.Sequential(*[checkpoint_wrapper(Counting()) for _ in range(4)])
    model[1].requires_grad_(False)
    model[2].requires_grad_(False)
    model(torch.rand(4, 2)).sum().backward()
    assert [block.calls for block in model] == [2, 2, 2, 2]


def test_frozen_module_feeding_non_tensor_outputs_is_not_recomputed():
    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0
            self.linear = nn.Linear(2, 2)

        def forward(self, x, y, z):
            self.calls += 1
            return self.linear(x + y), z + [self.calls], ["hi"]

    first, second, mixed, last = (checkpoint_wrapper(m) for m in (Counting(), Counting(), Mixed(), Counting()))
    first.requires_grad_(False)
    second.requires_grad_(False)
    x = torch.rand(4, 2)
    out, listed, constant = mixed(first(x), second(x), ["bye"])
    assert listed == ["bye", 1] and constant == ["hi"]
    last(out).sum().backward()
    assert (first.calls, second.calls, mixed.calls, last.calls) == (1, 1, 2, 2)


def test_disable_checkpointing_and_no_grad_run_plain_forward():
    model = checkpoint_wrapper(Counting())
    model(torch.rand(4, 2)).sum().backward()
    assert model.calls == 2
    model = checkpoint_wrapper(Counting())
    with activations.disable_checkpointing():
        model(torch.rand(4, 2)).sum().backward()
    assert model.calls == 1
    with torch.no_grad():
        assert not model(torch.rand(4, 2)).requires_grad
    assert model.calls == 2


def test_flags_are_set_in_forward_and_recompute_and_are_the_engines():
    seen = []

    class Probe(nn.Linear):
        def forward(self, x):
            seen.append((is_checkpointing(), is_recomputing()))
            return super().forward(x)

    model = checkpoint_wrapper(Probe(2, 2))
    model(torch.rand(3, 2)).sum().backward()
    assert seen == [(True, False), (False, True)]
    assert activations.thread_local is acshim.state.state
    assert isinstance(activations.thread_local, activations.ThreadLocalCheckpointingState)
    assert activations.is_recomputing is acshim.is_recomputing


def test_context_managers_nest_and_restore_per_thread():
    with activations.enable_recomputing():
        with activations.enable_recomputing():
            assert is_recomputing()
        assert is_recomputing()
        other = []
        thread = threading.Thread(target=lambda: other.append(is_recomputing()))
        thread.start()
        thread.join()
        assert other == [False]
    assert not is_recomputing()
    with activations.enable_checkpointing():
        assert is_checkpointing()
    assert not is_checkpointing()


def test_deep_copy_runs_the_copy_and_pickle_roundtrip_trains_identically():
    inputs = torch.randn(2, 8, 64)
    model = wrap_blocks(seeded(tiny_sequential))
    expected = train_step(model, inputs)
    clone = copy.deepcopy(model)
    with torch.no_grad():
        clone[0].fc1.weight.add_(1.0)
    assert clone[0].forward.module is clone[0]
    assert not torch.equal(clone(inputs), model(inputs))  # the copy runs its own parameters
    restored = pickle.loads(pickle.dumps(model))
    assert restored[0].forward.module is restored[0]
    assert_bitwise_equal(expected, train_step(restored, inputs))


def test_upstream_wrapped_module_cannot_be_pickled_but_facade_can():
    with pytest.raises(TypeError, match="weakref"):
        pickle.dumps(upstream_checkpoint_wrapper(nn.Linear(2, 2)))
    pickle.dumps(checkpoint_wrapper(nn.Linear(2, 2)))


def test_wrapping_twice_keeps_one_region():
    model = checkpoint_wrapper(checkpoint_wrapper(Counting()))
    model(torch.rand(4, 2)).sum().backward()
    assert model.calls == 2


def test_offload_to_cpu_is_truth_tested_and_keeps_gradients_bitwise_equal():
    inputs = torch.randn(2, 8, 64)
    expected = train_step(seeded(tiny_sequential), inputs)
    assert_bitwise_equal(expected, train_step(wrap_blocks(seeded(tiny_sequential), offload_to_cpu=True), inputs))
    off = checkpoint_wrapper(nn.Linear(2, 2), {})  # upstream's test passes {} and means "off"
    assert off.forward.options.saved_tensors_scope is None


def test_offload_to_cpu_routes_region_inputs_to_the_engine_host_tier():
    storage = pytest.importorskip("acshim.storage")
    with storage.recording() as sessions:
        model = wrap_blocks(seeded(tiny_sequential), offload_to_cpu=True)
        train_step(model, torch.randn(2, 8, 64))
    assert [(s.stats.storage, s.stats.saved) for s in sessions] == [("host", 1)] * 4  # one input per block
    assert all(s.stats.kept == 1 for s in sessions)  # CPU tensors are already in host memory: not copied


def test_reentrant_semantics_reject_autograd_grad():
    model = checkpoint_wrapper(nn.Linear(2, 2))
    x = torch.rand(3, 2, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"^Checkpointing is not compatible with \.grad\(\), please use \.backward\(\) if possible$"):
        torch.autograd.grad(model(x).sum(), x)


def test_patch_batchnorm_skips_statistics_in_no_grad_forward_as_upstream():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.BatchNorm1d(4))
    model[2].disable_patch_batchnorm = True
    handles = patch_batchnorm(model)
    assert len(handles) == 2  # a pre and a post hook on the one eligible layer
    with torch.no_grad():
        model(torch.randn(8, 3))
    assert model[1].num_batches_tracked.item() == 0 and model[2].num_batches_tracked.item() == 1
    assert model[1].track_running_stats  # restored after the call
    model(torch.randn(8, 3))
    assert model[1].num_batches_tracked.item() == 1
    for handle in handles:
        handle.remove()
    with torch.no_grad():
        model(torch.randn(8, 3))
    assert model[1].num_batches_tracked.item() == 2


def test_patch_batchnorm_inside_a_wrapped_module_still_updates_statistics_once():
    inputs = torch.randn(4, 3, 8, 8)
    expected = train_step(seeded(ConvBNNet), inputs)
    model = seeded(ConvBNNet)
    for block in model.blocks:
        patch_batchnorm(block)
        checkpoint_wrapper(block)
    assert_bitwise_equal(expected, train_step(model, inputs))


@pytest.mark.parametrize("norm", [nn.LayerNorm, nn.BatchNorm2d])
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_norm_layers_in_any_precision_train_like_unwrapped(norm, precision):
    # FairScale's test_checkpoint_activations_norm, on CPU (torch >= 2 runs half-precision norms there).
    def build(wrapped: bool) -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 2), norm(2))
        if precision == "fp16":
            model.half()
        return checkpoint_wrapper(model) if wrapped else model

    inputs = torch.rand(2, 2, 3, 3, dtype=torch.half if precision == "fp16" else torch.float, requires_grad=True)
    models = (build(False), build(True))
    for model in models:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model(inputs).sum().backward()
        optimizer.step()
    for (key, expected), (_, actual) in zip(models[0].state_dict().items(), models[1].state_dict().items()):
        assert torch.equal(expected, actual), key


def test_checkpoint_function_follows_upstream_calling_convention():
    from fairscale.internal.containers import pack_kwargs, unpack_non_tensors

    class Tagged(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(2, 2)

        def forward(self, x, scale=1.0):
            return self.linear(x) * scale, "tag"

    torch.manual_seed(0)
    module = Tagged()
    x = torch.rand(3, 2)
    kwarg_keys, flat = pack_kwargs(module, x, scale=3.0)
    parent: dict = {"offload": False}
    tensors = activations.CheckpointFunction.apply(torch.empty(0, requires_grad=True), type(module).forward, parent,
                                                   kwarg_keys, *flat)
    assert parent["output_requires_grad"] is True
    output = unpack_non_tensors(tensors, parent["packed_non_tensor_outputs"])
    assert output[1] == "tag"
    output[0].sum().backward()
    got = module.linear.weight.grad.clone()
    module.zero_grad()
    module(x, scale=3.0)[0].sum().backward()
    assert torch.equal(got, module.linear.weight.grad)


def test_rng_and_autocast_helpers_keep_upstream_names():
    state = activations.get_rng_state()
    first = torch.rand(3)
    activations.set_rng_state(state)
    assert torch.equal(first, torch.rand(3))
    assert activations.is_autocast_enabled() is False
    with activations.autocast(False):
        pass


def test_import_paths_deprecated_misc_and_nn_reexport_the_same_function():
    from acshim.facades.fairscale import nn as fs_nn
    from acshim.facades.fairscale.nn.misc import checkpoint_wrapper as deprecated

    assert fs_nn.checkpoint_wrapper is deprecated is checkpoint_wrapper is activations.checkpoint_wrapper
    assert activations.patch_batchnorm is patch_batchnorm
    with pytest.raises(AttributeError, match="activation checkpointing only"):
        fs_nn.FullyShardedDataParallel  # noqa: B018


def test_pipe_flags_are_separate_from_checkpoint_flags():
    from acshim.facades.fairscale.nn import pipe
    from acshim.facades.fairscale.nn.pipe import checkpoint as pipe_checkpoint

    with activations.enable_recomputing():
        assert is_recomputing() and not pipe.is_recomputing()
    with pipe_checkpoint.enable_checkpointing():
        assert pipe.is_checkpointing() and not is_checkpointing()
    with pytest.raises(AttributeError, match="pipeline parallelism"):
        pipe.Pipe  # noqa: B018


def test_acshim_patches_name_real_fairscale_entry_points_and_facade_objects():
    import importlib
    import pkgutil

    assert fairscale_facade.ACSHIM_PATCHES
    for upstream_module, attribute, facade_path in fairscale_facade.ACSHIM_PATCHES:
        assert callable(getattr(importlib.import_module(upstream_module), attribute))
        assert callable(pkgutil.resolve_name(facade_path))
