"""DeepSpeed 0.19's hidden-state offload (``deepspeed.runtime.activation_checkpointing.offload_activations``)
on acshim's storage tier.

The checks of upstream's tests/unit/runtime/activation_checkpointing/test_offload_activations.py that
run on CPU run here against both the real module (DeepSpeed 0.19.8, when installed) and the facade;
those upstream skips on CPU (they need a stream-capable accelerator) run against the facade with
the disk tier, which moves CPU tensors. Then a Hugging Face model, memory, and ``acshim run``.
"""

from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys
from functools import partial

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import acshim
from acshim.facades.deepspeed.runtime.activation_checkpointing import offload_activations as facade
from acshim.storage import reset_defaults

UPSTREAM = "deepspeed.runtime.activation_checkpointing.offload_activations"


@pytest.fixture(autouse=True)
def _fresh_defaults():
    reset_defaults()
    yield
    reset_defaults()


def _real_module():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        return importlib.import_module(UPSTREAM)
    except ImportError:
        pytest.skip("DeepSpeed >= 0.19 with offload_activations is not installed")


@pytest.fixture(params=["deepspeed", "acshim"])
def oa(request):
    """The module under test: DeepSpeed's own or the facade (same names, same behaviour on CPU)."""
    return _real_module() if request.param == "deepspeed" else facade


def _transformers_layer():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "GradientCheckpointingLayer"):
        pytest.skip("this transformers has no GradientCheckpointingLayer")
    return transformers.GradientCheckpointingLayer


def _tiny_layer():
    base = _transformers_layer()

    class Tiny(base):
        def forward(self, hidden_states):
            hidden_states = hidden_states.sin()
            return hidden_states * hidden_states

    layer = Tiny()
    layer.gradient_checkpointing = True
    layer._gradient_checkpointing_func = partial(checkpoint, use_reentrant=False)
    return layer.train()


def sin_square(x):
    return x.sin().square()


# ------------------------------------------------------------------- upstream's CPU checks, both modules


def test_saved_tensors_nobody_marked_are_left_alone(oa) -> None:
    x = torch.randn(4, 8, requires_grad=True)
    manager = oa.CheckpointHiddenStatesOffload(use_streams=False, min_offload_bytes=0)
    with manager:
        nn.Linear(8, 8)(x).square().sum().backward()
    assert x.grad is not None
    assert manager.stats.saved_tensors_seen > 0
    assert manager.stats.marked_tensors == manager.stats.offloaded_tensors == 0


def test_a_marked_cpu_tensor_stays_on_the_default_tier(oa) -> None:
    reference = torch.randn(4, 8, requires_grad=True)
    sin_square(checkpoint(sin_square, reference, use_reentrant=False)).sum().backward()
    x = reference.detach().clone().requires_grad_(True)
    manager = oa.CheckpointHiddenStatesOffload(use_streams=False, min_offload_bytes=0)
    with manager:
        manager.mark(x)
        sin_square(checkpoint(sin_square, x, use_reentrant=False)).sum().backward()
    assert manager.stats.marked_tensors == 1 and manager.stats.skipped_marked_tensors >= 1
    assert manager.stats.offloaded_tensors == 0
    assert torch.equal(x.grad, reference.grad)


@pytest.mark.parametrize("name", ["keep_last_count", "max_fwd_stash_count", "min_offload_bytes"])
def test_negative_counts_are_refused_by_name(oa, name) -> None:
    with pytest.raises(ValueError, match=name):
        oa.CheckpointHiddenStatesOffload(**{name: -1})


def test_hf_layers_take_hidden_states_first() -> None:
    """The marker assumes a checkpointing layer's first positional argument is ``hidden_states``."""
    _transformers_layer()
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    first = [p for p in inspect.signature(LlamaDecoderLayer.forward).parameters.values() if p.name != "self"][0]
    assert first.name == "hidden_states" and first.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD


def test_marker_patch_lives_exactly_as_long_as_the_context(oa) -> None:
    base = _transformers_layer()
    layer, original = _tiny_layer(), base.__call__
    x = torch.randn(4, 8, requires_grad=True)
    manager = oa.CheckpointHiddenStatesOffload(use_streams=False, min_offload_bytes=0, keep_last_count=0)
    with manager:
        assert base.__call__ is not original
        layer(x)
    assert base.__call__ is original
    assert manager.stats.marked_tensors == 1
    layer(x)  # outside: nobody marks
    assert manager.stats.marked_tensors == 1


def test_marker_patch_is_undone_when_the_block_raises(oa) -> None:
    base = _transformers_layer()
    original = base.__call__
    with pytest.raises(ValueError, match="boom"), oa.CheckpointHiddenStatesOffload(use_streams=False):
        raise ValueError("boom")
    assert base.__call__ is original


def test_nested_managers_share_one_patch_removed_by_the_outer(oa) -> None:
    base = _transformers_layer()
    original = base.__call__
    with oa.CheckpointHiddenStatesOffload(use_streams=False):
        patched = base.__call__
        assert patched is not original
        with oa.CheckpointHiddenStatesOffload(use_streams=False):
            assert base.__call__ is patched
        assert base.__call__ is patched
    assert base.__call__ is original


def test_one_manager_cannot_be_entered_twice(oa) -> None:
    manager = oa.CheckpointHiddenStatesOffload(use_streams=False)
    with manager, pytest.raises(RuntimeError, match="not re-entrant"):
        manager.__enter__()


def test_hf_layer_marks_its_input(oa) -> None:
    layer = _tiny_layer()
    x = torch.randn(4, 8, requires_grad=True)
    manager = oa.get_checkpoint_hidden_states_offloading_ctx_manager(use_streams=False, min_offload_bytes=0,
                                                                    keep_last_count=0)
    assert isinstance(manager, oa.CheckpointHiddenStatesOffload)
    with manager:
        layer(x).sum().backward()
    assert x.grad is not None
    assert manager.stats.marked_tensors == 1 <= manager.stats.saved_tensors_seen
    assert manager.stats.skipped_marked_tensors == 1  # on CPU, default tier: stays put


@pytest.mark.parametrize("pin", [True, False])
def test_host_buffer_helpers(oa, pin) -> None:
    manager = oa.CheckpointHiddenStatesOffload(use_streams=False, min_offload_bytes=0, use_pin_memory=pin)
    strided = torch.randn(6, 8)[:, ::2]
    buffer, key = manager._empty_cpu_like(strided)
    assert buffer.shape == strided.shape and buffer.is_contiguous()
    assert key == manager._buffer_key(torch.randn(6, 4))


# ------------------------------------------------------- upstream's accelerator-only checks, on the disk tier


def _disk(tmp_path, **options):
    options = {"use_streams": False, "min_offload_bytes": 0, "keep_last_count": 0, **options}
    return facade.CheckpointHiddenStatesOffload(storage="disk", directory=str(tmp_path), **options)


def _layers(seed):
    torch.manual_seed(seed)
    return nn.ModuleList([nn.Linear(16, 16) for _ in range(4)])


def _run_marked(layers, x, manager=None):
    h, marked = x * 2, []  # a non-leaf: leaves that require grad stay put (they live anyway)
    for layer in layers:
        if manager is not None:
            manager.mark(h)
            marked.append(h)
        h = checkpoint(layer, h, use_reentrant=False)
    return h.square().sum()


def _grads(layers, x):
    return [p.grad.clone() for p in layers.parameters()] + [x.grad.clone()]


@pytest.mark.parametrize("use_streams", [False, True])
@pytest.mark.parametrize("keep_last_count", [0, 1, 2])
def test_keep_last_count_on_disk_is_exact(tmp_path, use_streams, keep_last_count) -> None:
    layers, x = _layers(3), torch.randn(8, 16, requires_grad=True)
    loss = _run_marked(layers, x)
    loss.backward()
    expected = _grads(layers, x)
    manager = _disk(tmp_path, use_streams=use_streams, keep_last_count=keep_last_count)
    for _ in range(2):  # the same manager, step after step
        layers.zero_grad(set_to_none=True)
        x.grad = None
        with manager:
            got_loss = _run_marked(layers, x, manager)
            assert list(manager._keep_last) == list(range(5 - keep_last_count, 5))[:keep_last_count]
            got_loss.backward()
        assert torch.equal(got_loss, loss)
        assert all(torch.equal(a, b) for a, b in zip(_grads(layers, x), expected, strict=True))
        stats = manager.stats
        assert stats.marked_tensors == 4 and stats.kept_last_tensors == keep_last_count
        assert stats.offloaded_tensors == stats.restored_tensors == 4 - keep_last_count
        assert stats.offloaded_bytes == stats.restored_bytes == (4 - keep_last_count) * 8 * 16 * 4
        assert manager.scope.stats.sent_out >= 4 - keep_last_count


@pytest.mark.parametrize("view", ["offset", "strided"])
def test_views_go_to_disk_and_come_back_exact(tmp_path, view) -> None:
    base = torch.randn(6, 8, requires_grad=True)

    def make(b):
        h = b * 1
        return h[2:] if view == "offset" else h[:, ::2]

    sin_square(checkpoint(sin_square, make(base), use_reentrant=False)).sum().backward()
    expected, base.grad = base.grad.clone(), None
    manager = _disk(tmp_path)
    with manager:
        x = make(base)
        assert x.storage_offset() > 0 if view == "offset" else not x.is_contiguous()
        manager.mark(x)
        sin_square(checkpoint(sin_square, x, use_reentrant=False)).sum().backward()
    assert manager.stats.offloaded_tensors == manager.stats.restored_tensors == 1
    assert torch.equal(base.grad, expected)


def test_an_expanded_view_is_skipped(tmp_path) -> None:
    base = torch.randn(4, 8, requires_grad=True)
    manager = _disk(tmp_path)
    with manager:
        x = (base * 1).expand(2, 4, 8)
        manager.mark(x)
        sin_square(checkpoint(sin_square, x, use_reentrant=False)).sum().backward()
    assert manager.stats.offloaded_tensors == 0 and manager.stats.skipped_marked_tensors >= 1
    assert base.grad is not None


def test_retain_graph_restores_once(tmp_path) -> None:
    base = torch.randn(4, 8, requires_grad=True)
    manager = _disk(tmp_path)
    with manager:
        x = base * 1
        manager.mark(x)
        loss = sin_square(checkpoint(sin_square, x, use_reentrant=False)).sum()
        loss.backward(retain_graph=True)
        first, base.grad = base.grad.clone(), None
        loss.backward()
    assert manager.stats.restored_tensors == 1
    assert torch.equal(base.grad, first)


def test_zero_stash_still_exact(tmp_path) -> None:
    layers, x = _layers(11), torch.randn(8, 16, requires_grad=True)
    _run_marked(layers, x).backward()
    expected = _grads(layers, x)
    layers.zero_grad(set_to_none=True)
    x.grad = None
    manager = _disk(tmp_path, use_streams=True, max_fwd_stash_count=0)
    with manager:
        _run_marked(layers, x, manager).backward()
    assert all(torch.equal(a, b) for a, b in zip(_grads(layers, x), expected, strict=True))
    assert manager.stats.offloaded_tensors == manager.stats.restored_tensors == 4


# ----------------------------------------------------------------- a real HF model, memory, acshim run


def test_hf_llama_hidden_states_on_disk_exact_and_counted(tmp_path) -> None:
    pytest.importorskip("transformers")
    from acshim.testing import hf_inputs, hf_model

    inputs = hf_inputs("llama")
    layers = hf_model("llama").config.num_hidden_layers

    def step(manager):
        model = hf_model("llama")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if manager is None:
            model(**inputs).loss.backward()
        else:
            with manager:
                model(**inputs).loss.backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    expected = step(None)
    manager = facade.get_checkpoint_hidden_states_offloading_ctx_manager(min_offload_bytes=0, storage="disk",
                                                                         directory=str(tmp_path))
    got = step(manager)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    assert manager.stats.marked_tensors == layers
    assert manager.stats.offloaded_tensors == manager.stats.restored_tensors == layers - 1  # keep_last_count=1


class _Marked(nn.Module):
    """Eight checkpointed blocks whose inputs are marked for the manager (as the HF patch does)."""

    def __init__(self, manager=None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(8))
        self.manager = manager

    def forward(self, x):
        h = x * 1
        with self.manager or acshim.storage.no_offload():
            for block in self.blocks:
                if self.manager is not None:
                    self.manager.mark(h)
                h = checkpoint(block, h, use_reentrant=False)
        return h.square().mean()


def test_disk_tier_holds_less_for_backward(tmp_path) -> None:
    x = torch.randn(256, 256)
    plain = acshim.measure_memory(_Marked(), x).held_bytes
    manager = _disk(tmp_path, keep_last_count=1)
    offloaded = acshim.measure_memory(_Marked(manager), x).held_bytes
    block_input = 256 * 256 * 4
    assert manager.stats.offloaded_tensors == 7
    assert offloaded <= plain - 6 * block_input, (plain, offloaded)


SCRIPT = """
import torch
from torch.utils.checkpoint import checkpoint
from deepspeed.runtime.activation_checkpointing.offload_activations import (
    CheckpointHiddenStatesOffload, get_checkpoint_hidden_states_offloading_ctx_manager)
manager = get_checkpoint_hidden_states_offloading_ctx_manager(min_offload_bytes=0, keep_last_count=0)
print(type(manager).__module__, CheckpointHiddenStatesOffload.__module__)
"""


@pytest.mark.parametrize("upstream", ["installed", "absent"])
def test_acshim_run_serves_the_module(tmp_path, upstream) -> None:
    if upstream == "installed":
        _real_module()
    (tmp_path / "train.py").write_text(SCRIPT)
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    args = [sys.executable, "-m", "acshim", "run", "train.py"]
    if upstream == "absent":  # hide DeepSpeed: the import name is served by the facade package
        (tmp_path / "hide.py").write_text(
            "import sys\nclass Block:\n    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'deepspeed' or name.startswith('deepspeed.'):\n            raise ImportError(name)\n"
            "sys.meta_path.insert(0, Block())\nfrom acshim.cli import main\nsys.exit(main(sys.argv[1:]))\n")
        args = [sys.executable, "hide.py", "run", "train.py"]
    done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [facade.__name__] * 2


def test_the_environment_selects_the_disk_tier_for_an_unchanged_script(tmp_path, monkeypatch) -> None:
    """ACSHIM_OFFLOAD_STORAGE / ACSHIM_OFFLOAD_DIR choose the tier when the script passes neither
    (upstream's API has no storage argument); an explicit keyword still wins."""
    monkeypatch.setenv("ACSHIM_OFFLOAD_STORAGE", "disk")
    monkeypatch.setenv("ACSHIM_OFFLOAD_DIR", str(tmp_path))
    layers, x = _layers(3), torch.randn(8, 16, requires_grad=True)
    _run_marked(layers, x).backward()
    expected = _grads(layers, x)
    layers.zero_grad(set_to_none=True)
    x.grad = None
    manager = facade.CheckpointHiddenStatesOffload(use_streams=False, min_offload_bytes=0, keep_last_count=0)
    assert manager.storage == "disk"
    with manager:
        _run_marked(layers, x, manager).backward()
    assert manager.stats.offloaded_tensors == 4  # CPU tensors move only on the disk tier
    assert all(torch.equal(a, b) for a, b in zip(_grads(layers, x), expected, strict=True))
    assert facade.CheckpointHiddenStatesOffload(storage="host").storage == "host"
