"""DeepSpeed facade against the real DeepSpeed 0.19.8 installed here: gradients, held memory, and the
entry points ACSHIM_PATCHES replaces in the real package."""

from __future__ import annotations

import contextlib
import importlib
import inspect

import pytest
import torch
from torch import nn

from acshim.facades import deepspeed as facade_package
from acshim.facades.deepspeed import ACSHIM_PATCHES, UPSTREAM_CHECKPOINTING, _upstream
from acshim.facades.deepspeed.runtime.activation_checkpointing._state import GLOBAL_NAMES, LOCAL_ONLY, STATE
from acshim.measure import measure_memory
from acshim.testing import assert_bitwise_equal, train_step

real_deepspeed = pytest.importorskip("deepspeed")
real = importlib.import_module(UPSTREAM_CHECKPOINTING)
facade = facade_package.checkpointing
SEED = 1234


@pytest.fixture(autouse=True)
def fresh_state():
    STATE.reset()
    facade.get_cuda_rng_tracker().reset()
    saved = {name: real.__dict__[name] for name in GLOBAL_NAMES if name in real.__dict__}
    yield
    real.__dict__.update(saved)
    STATE.reset()
    facade.get_cuda_rng_tracker().reset()


@contextlib.contextmanager
def real_flags(**flags):
    saved = {name: getattr(real, name) for name in flags}
    for name, value in flags.items():
        setattr(real, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(real, name, value)


class Block(nn.Module):
    def __init__(self, tracker_fn, width: int = 32) -> None:
        super().__init__()
        self.tracker_fn = tracker_fn
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)
        self.attention_dropout = nn.Dropout(0.25)
        self.hidden_dropout = nn.Dropout(0.1)

    def forward(self, hidden, mask):
        inner = self.fc1(self.norm(hidden))
        with self.tracker_fn().fork():
            inner = self.attention_dropout(inner)
        inner = torch.nn.functional.gelu(inner) * mask.to(inner.dtype)
        return hidden + self.hidden_dropout(self.fc2(inner))


class Stack(nn.Module):
    def __init__(self, checkpoint_fn, tracker_fn, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(tracker_fn) for _ in range(depth))
        self.checkpoint_fn = checkpoint_fn

    def forward(self, hidden, mask):
        hidden = hidden * 1.0
        for layer in self.layers:
            hidden = layer(hidden, mask) if self.checkpoint_fn is None else self.checkpoint_fn(layer, hidden, mask)
        return hidden


def inputs():
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 16, 32, generator=generator).requires_grad_()  # upstream's reentrant mode needs it
    return hidden, torch.rand(2, 16, 128, generator=generator) > 0.1


def build(checkpoint_fn, tracker_fn) -> Stack:
    torch.manual_seed(0)
    return Stack(checkpoint_fn, tracker_fn)


def seed_facade() -> None:
    facade.model_parallel_cuda_manual_seed(SEED)


def seed_real() -> None:
    # real model_parallel_cuda_manual_seed needs deepspeed.init_distributed(); seed its tracker directly
    tracker = real.get_cuda_rng_tracker()
    tracker.reset()
    torch.manual_seed(SEED)
    tracker.add("model-parallel-rng", SEED + 2718)


def step(model, seed_fn):
    seed_fn()
    return train_step(model, inputs())


def held(model, seed_fn) -> int:
    seed_fn()
    return measure_memory(model, inputs(), blocks=[]).held_bytes


@pytest.mark.parametrize("entry", ["checkpoint", "non_reentrant_checkpoint"])
@pytest.mark.parametrize("partition", [False, True], ids=["plain", "partition_mp1"])
def test_gradients_equal_real_deepspeed_and_memory_is_not_higher(entry, partition):
    plain = step(build(None, facade.get_cuda_rng_tracker), seed_facade)
    with real_flags(PARTITION_ACTIVATIONS=partition):
        upstream_model = build(getattr(real, entry), real.get_cuda_rng_tracker)
        upstream = step(upstream_model, seed_real)
        upstream_held = held(upstream_model, seed_real)
    facade.PARTITION_ACTIVATIONS = partition
    facade_model = build(getattr(facade, entry), facade.get_cuda_rng_tracker)
    ours = step(facade_model, seed_facade)
    ours_held = held(facade_model, seed_facade)
    plain_held = held(build(None, facade.get_cuda_rng_tracker), seed_facade)
    assert_bitwise_equal(upstream, ours)
    assert_bitwise_equal(plain, ours)
    assert ours_held <= upstream_held
    assert ours_held < plain_held / 3


def test_real_cpu_checkpointing_breaks_on_cpu_where_the_facade_is_exact():
    x = torch.randn(3, 4)
    layer = nn.Linear(4, 4)
    with real_flags(CPU_CHECKPOINT=True):
        hidden = x * 1.0
        out = real.checkpoint(layer, hidden)
        assert hidden.shape == ()  # upstream emptied the caller's tensor and kept an alias of it
        with pytest.raises(RuntimeError):
            out.sum().backward()
    layer.zero_grad()
    facade.CPU_CHECKPOINT = True
    facade.checkpoint(layer, x * 1.0).sum().backward()
    ours = layer.weight.grad.clone()
    layer.zero_grad()
    layer(x).sum().backward()
    assert torch.equal(ours, layer.weight.grad)


def test_reentrant_real_deepspeed_gives_no_parameter_gradients_without_an_input_requiring_grad():
    layer = nn.Linear(4, 4)
    with pytest.raises(RuntimeError, match="does not require grad"):
        real.checkpoint(layer, torch.randn(2, 4)).sum().backward()
    facade.checkpoint(layer, torch.randn(2, 4)).sum().backward()
    assert layer.weight.grad is not None


def _parameters(function) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


def test_acshim_patches_name_real_entry_points_with_upstream_signatures():
    assert {name for _, name, _ in ACSHIM_PATCHES} >= {
        "checkpoint", "non_reentrant_checkpoint", "configure", "is_configured", "reset", "get_cuda_rng_tracker",
        "model_parallel_cuda_manual_seed", "model_parallel_reconfigure_tp_seed"}
    for module_name, attribute, target in ACSHIM_PATCHES:
        original = getattr(importlib.import_module(module_name), attribute)
        module_path, _, name = target.rpartition(".")
        replacement = getattr(importlib.import_module(module_path), name)
        assert callable(replacement)
        upstream = _parameters(inspect.unwrap(original))
        ours = _parameters(replacement)
        # upstream's parameters, in order, with its defaults; extras only keyword-only with a default
        # (the hidden-state offload's storage=/directory=), so every upstream call means the same
        assert ours[:len(upstream)] == upstream, attribute
        extras = ours[len(upstream):]
        assert all(kind is inspect.Parameter.KEYWORD_ONLY and default is not inspect.Parameter.empty
                   for _, kind, default in extras), (attribute, extras)


@contextlib.contextmanager
def patched_real_module():
    """What acshim.install() does to the real module (by plain setattr here; restored after)."""
    names = [attribute for module, attribute, _ in ACSHIM_PATCHES if module == UPSTREAM_CHECKPOINTING]
    originals = {attribute: real.__dict__[attribute] for attribute in names}
    for attribute in names:
        setattr(real, attribute, getattr(_upstream, attribute))
    try:
        yield
    finally:
        for attribute, original in originals.items():
            setattr(real, attribute, original)


def test_patched_real_module_globals_are_the_one_state():
    with patched_real_module():
        assert real_deepspeed.checkpointing.configure is _upstream.configure
        real_deepspeed.checkpointing.configure(None, partition_activations=True, num_checkpoints=4)  # no dist
        assert real.PARTITION_ACTIVATIONS is True and real.num_layers == 4 and real.is_configured() is True
        assert facade.PARTITION_ACTIVATIONS is False  # the facade's own store is untouched
        real.mp_size = 2  # a script's write to the real module is what the patched checkpoint reads
        with pytest.raises(AssertionError, match="not divisible by mp size"):
            real.checkpoint(torch.sin, torch.randn(3, requires_grad=True))
        real.mp_size = 1
        real.model_parallel_cuda_manual_seed(3)  # no mpu, no dist: fine when patched
        assert real.get_cuda_rng_tracker() is facade.get_cuda_rng_tracker()
        x = torch.randn(4, requires_grad=True)
        hidden = x * 1.0
        real.checkpoint(torch.sin, hidden).sum().backward()
        assert hidden.shape == (4,) and torch.equal(x.grad, x.detach().cos())
    assert not isinstance(real.__dict__["_CUDA_RNG_STATE_TRACKER"], facade.CudaRNGStatesTracker)
    assert "_CUDA_RNG_STATE_TRACKER" in LOCAL_ONLY  # upstream's own tracker object stays in place
