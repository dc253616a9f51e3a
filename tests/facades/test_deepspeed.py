"""DeepSpeed facade: checkpoint / non_reentrant_checkpoint semantics, layout and upstream's own checks."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from torch import nn

from acshim.facades import deepspeed
from acshim.facades.deepspeed.runtime.activation_checkpointing._state import STATE
from acshim.testing import assert_bitwise_equal, train_step

ckpt = deepspeed.checkpointing
MODES = {"reentrant": ckpt.checkpoint, "non_reentrant": ckpt.non_reentrant_checkpoint}


@pytest.fixture(autouse=True)
def fresh_state():
    STATE.reset()
    ckpt.get_cuda_rng_tracker().reset()
    yield
    STATE.reset()
    ckpt.get_cuda_rng_tracker().reset()


# --------------------------------------------------------------------------------------------------
# a Megatron-style model: attention dropout on the tracker's stream, hidden dropout on the default one


class ParallelBlock(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)
        self.attention_dropout = nn.Dropout(0.3)
        self.hidden_dropout = nn.Dropout(0.2)
        self.calls = 0

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        inner = self.fc1(self.norm(hidden))
        with ckpt.get_cuda_rng_tracker().fork():
            inner = self.attention_dropout(inner)
        inner = torch.nn.functional.gelu(inner) * mask.to(inner.dtype)
        return hidden + self.hidden_dropout(self.fc2(inner))


class ParallelStack(nn.Module):
    """Checkpoints ``chunk`` layers at a time, as Megatron's ``_checkpointed_forward`` does."""

    def __init__(self, checkpoint_fn=None, depth: int = 4, chunk: int = 2, width: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ParallelBlock(width) for _ in range(depth))
        self.checkpoint_fn = checkpoint_fn
        self.chunk = chunk

    def custom(self, start: int, end: int):
        def run(*inputs):
            hidden = inputs[0]
            for layer in self.layers[start:end]:
                hidden = layer(hidden, inputs[1])
            return hidden

        return run

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        hidden = hidden * 1.0  # a non-leaf activation, as embeddings give
        for start in range(0, len(self.layers), self.chunk):
            run = self.custom(start, start + self.chunk)
            hidden = run(hidden, mask) if self.checkpoint_fn is None else self.checkpoint_fn(run, hidden, mask)
        return hidden


def megatron_inputs():
    generator = torch.Generator().manual_seed(3)
    return torch.randn(4, 8, 16, generator=generator), torch.rand(4, 8, 32, generator=generator) > 0.2


def seeded_step(model: nn.Module, inputs) -> dict:
    ckpt.model_parallel_cuda_manual_seed(1234)
    state = train_step(model, inputs)
    state["tracker"] = ckpt.get_cuda_rng_tracker().get_states()["model-parallel-rng"]
    return state


@pytest.mark.parametrize("mode", MODES)
def test_megatron_stack_gradients_bitwise_equal_with_dropout_and_tracker(mode):
    torch.manual_seed(0)
    plain = ParallelStack()
    checkpointed = copy.deepcopy(plain)
    checkpointed.checkpoint_fn = MODES[mode]
    expected = seeded_step(plain, megatron_inputs())
    actual = seeded_step(checkpointed, megatron_inputs())
    assert_bitwise_equal(expected, actual)  # includes the tracker stream's final state
    assert [layer.calls for layer in checkpointed.layers] == [2] * 4  # every layer was recomputed once


def test_kwargs_tensors_get_gradients_like_positionals():
    weight = torch.randn(5, requires_grad=True)
    scale = torch.randn(5, requires_grad=True)

    def function(x, *, scale, bias=0.0):
        return (x * scale + bias).sin()

    out = ckpt.checkpoint(function, weight, scale=scale, bias=1.0)
    out.sum().backward()
    grads = (weight.grad.clone(), scale.grad.clone())
    weight.grad = scale.grad = None
    function(weight, scale=scale, bias=1.0).sum().backward()
    assert torch.equal(grads[0], weight.grad) and torch.equal(grads[1], scale.grad)


@pytest.mark.parametrize("mode", MODES)
def test_leaf_tensors_nested_in_container_args_get_gradients(mode):
    x, y = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    MODES[mode](lambda pair, k: (pair[0] * pair[1] * k).sum(), [x, y], 2.0).backward()
    assert torch.equal(x.grad, y.detach() * 2.0) and torch.equal(y.grad, x.detach() * 2.0)


def test_non_reentrant_checkpoint_rejects_kwargs_like_upstream():
    with pytest.raises(TypeError):
        ckpt.non_reentrant_checkpoint(torch.sin, x=torch.randn(2))


@pytest.mark.parametrize("mode", MODES)
def test_outputs_are_normalised_like_upstream(mode):
    checkpoint = MODES[mode]
    x = torch.randn(3, requires_grad=True)
    marker = object()
    assert torch.is_tensor(checkpoint(lambda t: t * 2, x))
    one = checkpoint(lambda t: (t * 2,), x)
    assert torch.is_tensor(one) and one.grad_fn is not None  # a 1-tuple is unwrapped
    several = checkpoint(lambda t: [t * 2, marker, 3], x)
    assert type(several) is tuple and len(several) == 3
    assert several[1] is marker and several[2] == 3  # non-tensors kept, same objects
    several[0].sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))


@pytest.mark.parametrize("mode", MODES)
def test_dict_outputs_are_returned_as_dicts_not_their_keys(mode):
    x = torch.randn(3, requires_grad=True)
    out = MODES[mode](lambda t: {"y": t.exp(), "n": 1}, x)
    assert isinstance(out, dict) and out["n"] == 1
    out["y"].sum().backward()
    assert torch.equal(x.grad, x.detach().exp())


@pytest.mark.parametrize("mode", MODES)
def test_parameters_get_gradients_when_no_input_requires_grad(mode):
    torch.manual_seed(0)
    layer = nn.Linear(4, 4)
    reference = copy.deepcopy(layer)
    x = torch.randn(2, 4)
    MODES[mode](layer, x).sum().backward()
    reference(x).sum().backward()
    assert torch.equal(layer.weight.grad, reference.weight.grad)
    assert torch.equal(layer.bias.grad, reference.bias.grad)


def test_zero_argument_function_gives_parameter_gradients():
    weight = nn.Parameter(torch.randn(3))
    ckpt.checkpoint(lambda: weight.square().sum()).backward()
    assert torch.equal(weight.grad, 2 * weight.detach())


@pytest.mark.parametrize("flags", [{"PARTITION_ACTIVATIONS": True}, {"CPU_CHECKPOINT": True},
                                   {"PARTITION_ACTIVATIONS": True, "CPU_CHECKPOINT": True}])
def test_recompute_gets_exactly_the_original_arguments(flags):
    for name, value in flags.items():
        setattr(ckpt, name, value)
    seen = []

    def function(x, count, nothing, option=None):
        seen.append((count, nothing, option))
        return x * count

    x = torch.randn(3, requires_grad=True)
    ckpt.checkpoint(function, x, 3, None).sum().backward()
    assert seen == [(3, None, None), (3, None, None)]  # upstream recomputes f(x, 3, None, None, None)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("flags", [{"PARTITION_ACTIVATIONS": True}, {"CPU_CHECKPOINT": True}])
def test_partition_and_cpu_modes_give_caller_tensors_back_whole(mode, flags):
    """Partitioning empties the caller's input until backward, as upstream (shape ``()``), then gives
    it back whole (upstream leaves it flat with one rank and breaks a leaf's grad accumulation);
    CPU checkpointing alone never empties it (on a CPU machine the kept copy is the input itself)."""
    for name, value in flags.items():
        setattr(ckpt, name, value)
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.5))
    reference = copy.deepcopy(layer)
    x = torch.randn(2, 6, requires_grad=True)  # a leaf: upstream fails at grad accumulation here
    torch.manual_seed(5)
    out = MODES[mode](layer, x)
    assert x.shape == (() if "PARTITION_ACTIVATIONS" in flags else (2, 6))
    out.sum().backward()
    assert x.shape == (2, 6)  # upstream leaves it flat, (12,)
    expected_x = x.grad.clone()
    x.grad = None
    torch.manual_seed(5)
    reference(x).sum().backward()
    assert torch.equal(expected_x, x.grad)
    assert torch.equal(layer[0].weight.grad, reference[0].weight.grad)


def test_no_grad_call_is_plain_and_keeps_inputs():
    ckpt.PARTITION_ACTIVATIONS = True
    x = torch.randn(4)
    with torch.no_grad():
        out = ckpt.checkpoint(lambda t, k: (t + k, k), x, 2)
    assert out[1] == 2 and torch.equal(out[0], x + 2) and x.shape == (4,)  # upstream hollows x forever


def test_autograd_grad_through_reentrant_checkpoint_raises():
    x = torch.randn(3, requires_grad=True)
    out = ckpt.checkpoint(torch.sin, x)
    with pytest.raises(RuntimeError, match=r"^Checkpointing is not compatible with \.grad\(\), please use \.backward\(\) if possible$"):
        torch.autograd.grad(out.sum(), x)


def test_non_reentrant_checkpoint_supports_autograd_grad_and_double_backward():
    x = torch.randn(3, requires_grad=True)
    out = ckpt.non_reentrant_checkpoint(torch.sin, x)
    (grad,) = torch.autograd.grad(out.sum(), x, retain_graph=True)
    assert torch.equal(grad, x.detach().cos())
    out.sum().backward(retain_graph=True)
    out.sum().backward()
    assert torch.equal(x.grad, 2 * x.detach().cos())


def test_constant_tensor_outputs_are_not_rewired():
    constant = torch.randn(5)
    layer = nn.Linear(5, 5)
    x = torch.randn(5, requires_grad=True)
    out, extra = ckpt.checkpoint(lambda t: (layer(t), (None, True, constant)), x)
    assert constant.grad_fn is None and not constant.requires_grad
    out.sum().backward()  # upstream-style rewiring of `constant` would recurse forever here
    assert torch.equal(extra[2], constant)


def test_checkpoint_function_apply_fills_all_outputs_and_returns_tensors():
    x = torch.randn(3, requires_grad=True)
    all_outputs: list = []
    tensors = ckpt.CheckpointFunction.apply(lambda t: (t * 3, "tag", t * 2), all_outputs, x)
    assert len(all_outputs) == 3 and all_outputs[1] == "tag"
    assert len(tensors) == 2 and all(torch.is_tensor(t) for t in tensors)
    (all_outputs[0].sum() + all_outputs[2].sum()).backward()
    assert torch.equal(x.grad, torch.full((3,), 5.0))
    single: list = []
    assert torch.is_tensor(ckpt.CheckpointFunction.apply(torch.cos, single, x)) and len(single) == 1


def test_detach_variable_keeps_requires_grad_and_rejects_non_tuples():
    x = torch.randn(2, requires_grad=True)
    detached = ckpt.detach_variable((x, 3))
    assert detached[1] == 3 and detached[0].requires_grad and detached[0].grad_fn is None
    with pytest.raises(RuntimeError, match="Only tuple of tensors is supported"):
        ckpt.detach_variable([x])


def test_extract_and_merge_tensors_round_trip_in_partition_mode():
    ckpt.PARTITION_ACTIVATIONS = True  # upstream's merge drops/duplicates entries in this mode
    items = (torch.zeros(1), 3, None, torch.ones(2), "s")
    tensors, others, flags = ckpt.extract_tensors(items)
    assert flags == (True, False, False, True, False) and others == (3, None, "s")
    merged = ckpt.merge_tensors(tensors, others, flags)
    assert len(merged) == 5 and merged[1:3] == (3, None) and merged[4] == "s"
    assert ckpt.extract_tensors(list(items))[2] == [True, False, False, True, False]


def test_activation_rules_and_partition_sizes():
    ckpt.mp_size, ckpt.mp_rank = 2, 1
    assert ckpt.is_activation_to_checkpoint(torch.randn(4))
    assert not ckpt.is_activation_to_checkpoint(torch.ones(4, dtype=torch.bool))
    assert not ckpt.is_activation_to_checkpoint(torch.randn(1))  # fewer elements than mp_size
    tagged = torch.randn(4)
    tagged.no_checkpointing = True
    assert not ckpt.is_activation_to_checkpoint(tagged) and not ckpt.is_activation_to_checkpoint(3.0)
    assert (ckpt.get_partition_size(torch.randn(6)), ckpt.get_partition_start(torch.randn(6))) == (3, 3)
    with pytest.raises(AssertionError, match="not divisible by mp size"):
        ckpt.get_partition_size(torch.randn(5))


def test_checkpointing_module_is_one_object_under_every_import_path():
    runtime_module = importlib.import_module("acshim.facades.deepspeed.runtime.activation_checkpointing.checkpointing")
    short_module = importlib.import_module("acshim.facades.deepspeed.checkpointing")
    from acshim.facades.deepspeed import checkpointing

    assert checkpointing is runtime_module is short_module is deepspeed.checkpointing


# --------------------------------------------------------------------------------------------------
# DeepSpeed's own checks (tests/unit/runtime/activation_checkpointing/, run here on CPU and encoded
# with bitwise equality; upstream skips them on the CPU accelerator)

HIDDEN = 20


class MaskedLinear(nn.Linear):
    def forward(self, x, mask):
        out = super().forward(x)
        return out * (mask if mask.is_floating_point() else mask.type_as(out))


class MaskedLinearSeq(MaskedLinear):
    def forward(self, x, mask):
        return super().forward(x, mask), mask


class MaskedLinearSeqDup(MaskedLinearSeq):
    def forward(self, x, mask):
        dup = x.clone().detach() * 1.38
        x, mask = super().forward(x, mask)
        return dup, x, mask


class DropMaskLinear(nn.Linear):
    def forward(self, x, mask):
        return super().forward(x)


class LinearNonTensorOutput(nn.Linear):
    def __init__(self, non_tensor_output):
        super().__init__(HIDDEN, HIDDEN)
        self.non_tensor_output = non_tensor_output

    def forward(self, x):
        return super().forward(x), self.non_tensor_output


def _compute(module, inputs, checkpoint=None):
    outputs = checkpoint(module, *inputs) if checkpoint else module(*inputs)
    outputs = (outputs,) if torch.is_tensor(outputs) else outputs
    sum(o.sum() for o in outputs if torch.is_tensor(o) and o.requires_grad).backward()
    return outputs, [p.grad for p in module.parameters()], [i.grad for i in inputs if torch.is_tensor(i)]


def _match(reference, candidate):
    assert type(reference) is type(candidate)
    if isinstance(reference, (list, tuple)):
        assert len(reference) == len(candidate)
        for r, c in zip(reference, candidate):
            _match(r, c)
    elif torch.is_tensor(reference):
        assert torch.equal(reference, candidate)
    else:
        assert reference == candidate


def _check_against_plain(checkpoint, module, *inputs):
    module.eval()
    results = []
    for use in (None, checkpoint):
        candidate = copy.deepcopy(module)
        copies = tuple(copy.deepcopy(i) for i in inputs)
        results.append(_compute(candidate, copies, use))
    _match(results[0], results[1])
    assert all(g is not None for g in results[1][1])  # parameters got gradients


def _mask(kind):
    torch.manual_seed(7)
    mask = torch.randn(HIDDEN) > 0
    return mask if kind == "bool" else mask.float()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("input_grad", [True, False], ids=["with_grad", "without_grad"])
@pytest.mark.parametrize("mask_kind", ["bool", "float"])
@pytest.mark.parametrize("module_class", [nn.Linear, MaskedLinear, MaskedLinearSeq, MaskedLinearSeqDup,
                                          DropMaskLinear])
def test_upstream_activation_checkpoint_cases(mode, input_grad, mask_kind, module_class):
    torch.manual_seed(0)
    module = module_class(HIDDEN, HIDDEN)
    x = torch.rand(HIDDEN, requires_grad=input_grad)
    if module_class is nn.Linear:
        _check_against_plain(MODES[mode], module, x)
    elif module_class is DropMaskLinear:
        _check_against_plain(MODES[mode], module, x, None)  # upstream's test_ckpt_arg_none
    else:
        _check_against_plain(MODES[mode], module, x, _mask(mask_kind))


NON_TENSORS = [None, 2, True, (None, 2.5), (None, True, torch.randn(HIDDEN))]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("input_grad", [True, False], ids=["with_grad", "without_grad"])
@pytest.mark.parametrize("non_tensor", NON_TENSORS, ids=["none", "int", "bool", "tuple", "tuple_with_tensor"])
def test_upstream_non_tensor_inputs_and_outputs(mode, input_grad, non_tensor):
    torch.manual_seed(0)
    x = torch.rand(HIDDEN, requires_grad=input_grad)
    _check_against_plain(MODES[mode], DropMaskLinear(HIDDEN, HIDDEN), x, non_tensor)
    _check_against_plain(MODES[mode], LinearNonTensorOutput(non_tensor), x)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("non_tensor_output", [None, (torch.randn(HIDDEN), 2.5), (None, torch.randn(HIDDEN), True),
                                               (None, True, torch.randn(HIDDEN))])
def test_upstream_non_tensor_output_ordering(mode, non_tensor_output):
    module = LinearNonTensorOutput(non_tensor_output).eval()
    outputs = MODES[mode](module, torch.rand(HIDDEN, requires_grad=True))
    ordering = []
    for item in outputs:
        ordering += [torch.is_tensor(t) for t in item] if isinstance(item, (list, tuple)) else [torch.is_tensor(item)]
    expected = [True] + ([torch.is_tensor(t) for t in non_tensor_output] if isinstance(non_tensor_output, tuple)
                         else [torch.is_tensor(non_tensor_output)])
    assert ordering == expected
