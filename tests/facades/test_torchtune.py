"""torchtune's activation offloading (``torchtune.training.OffloadActivations``, ``NoOpManager``,
``get_act_offloading_ctx_manager``; torchtune 0.6) served by ``acshim.offload``: scripts run unchanged
under ``acshim run`` without torchtune (whose own manager needs CUDA), gradients bitwise equal to the
run without offload, and with ``ACSHIM_OFFLOAD_STORAGE=disk`` less memory held and at peak."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import acshim
from acshim.facades.torchtune import training
from acshim.storage import reset_defaults


@pytest.fixture(autouse=True)
def _fresh_defaults():
    reset_defaults()
    yield
    reset_defaults()


class Model(nn.Module):
    """torchtune's layout: blocks, then the output head at ``model.output``."""

    def __init__(self, width: int = 64, layers: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                                    for _ in range(layers))
        self.output = nn.Linear(width, 100)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return self.output(x)


def _step(model, x, ctx):
    model.zero_grad(set_to_none=True)
    with ctx:
        logits = model(x)
    logits.square().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_arguments_and_errors_are_torchtunes() -> None:
    manager = training.OffloadActivations(use_pin_memory=False, use_streams=False, max_fwd_stash_size=0,
                                          min_offload_size=4096)
    assert isinstance(manager, acshim.storage.OffloadActivations)
    assert manager.options.min_bytes == manager.min_tensor_size_bytes == 4096
    assert training.OffloadActivations().use_streams is True
    with pytest.raises(ValueError, match="max_fwd_stash_size should be at least 1 but is 0"):
        training.OffloadActivations(use_streams=True, max_fwd_stash_size=0)


def test_disabled_is_a_null_context() -> None:
    assert isinstance(training.get_act_offloading_ctx_manager(Model(), False), contextlib.nullcontext)


def test_recipe_switch_offloads_all_but_the_head_on_disk_exactly(tmp_path, monkeypatch) -> None:
    x = torch.randn(32, 64)
    expected = _step(Model(), x, contextlib.nullcontext())
    monkeypatch.setenv("ACSHIM_OFFLOAD_STORAGE", "disk")
    monkeypatch.setenv("ACSHIM_OFFLOAD_DIR", str(tmp_path))
    model = Model()
    manager = training.get_act_offloading_ctx_manager(model, True)
    assert manager.options.storage == "disk" and manager.options.directory == str(tmp_path)
    for _ in range(2):  # hooks on the head stay balanced step after step
        got = _step(model, x, manager)
        assert all(torch.equal(expected[k], got[k]) for k in expected)
        stats = manager.stats
        assert stats.moved > 0 and stats.kept >= 1  # the head's input stays
        assert stats.saved == stats.moved + stats.kept


def test_no_op_manager_opts_a_block_out(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ACSHIM_OFFLOAD_STORAGE", "disk")
    monkeypatch.setenv("ACSHIM_OFFLOAD_DIR", str(tmp_path))
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(32, 64)
    manager = training.OffloadActivations(min_offload_size=0)
    with manager:
        with training.NoOpManager():
            y = (x @ w).tanh()
    assert manager.stats.moved == 0 and manager.stats.saved == 0
    with manager:
        y = (x @ w).tanh()
    y.sum().backward()
    assert manager.stats.moved >= 1


def test_no_head_warns_as_torchtune() -> None:
    with pytest.warns(UserWarning, match="no output head was detected"):
        training.get_act_offloading_ctx_manager(nn.Sequential(nn.Linear(4, 4)), True)


def test_head_found_behind_wrappers_and_hf_names() -> None:
    class HF(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm_head = nn.Linear(4, 4)

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = HF()

    model = Wrapped()
    training.get_act_offloading_ctx_manager(model, True)
    assert model.module.lm_head._forward_pre_hooks and model.module.lm_head._forward_hooks


SCRIPT = '''
import ctypes, sys
import torch
from torch import nn
from torchtune import training

torch.manual_seed(0)
torch.set_num_threads(1)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
                                    for _ in range(6))
        self.output = nn.Linear(256, 500)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return self.output(x)


def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024


model, x = Model(), torch.randn(1024, 256)
ctx = training.get_act_offloading_ctx_manager(model, sys.argv[1] == "on")
ctypes.CDLL("libc.so.6").malloc_trim(0)
open("/proc/self/clear_refs", "w").write("5")
base = status("VmRSS:")
with ctx:
    logits = model(x)
held = status("VmRSS:") - base
logits.square().mean().backward()
peak = status("VmHWM:") - base
torch.save({n: p.grad for n, p in model.named_parameters()}, sys.argv[2])
print(held, peak)
'''


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc to measure RSS")
def test_torchtune_script_runs_unchanged_and_disk_tier_lowers_memory(tmp_path) -> None:
    """The recipe pattern under ``acshim run`` (torchtune absent or not): bitwise gradients; the disk
    tier, selected by ``ACSHIM_OFFLOAD_STORAGE=disk``, holds less after forward and peaks lower
    (RSS as docs/measuring.md measures it)."""
    (tmp_path / "train.py").write_text(SCRIPT)
    results, reference = {}, None
    for name, mode, storage in (("plain", "off", ""), ("host", "on", ""), ("disk", "on", "disk")):
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "ACSHIM_OFFLOAD_STORAGE": storage,
               "ACSHIM_OFFLOAD_DIR": str(tmp_path)}
        done = subprocess.run([sys.executable, "-m", "acshim", "run", "train.py", mode, f"{name}.pt"], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        results[name] = [int(v) for v in done.stdout.split()]
        grads = torch.load(tmp_path / f"{name}.pt")
        reference = grads if reference is None else reference
        assert all(torch.equal(reference[k], grads[k]) for k in reference)
    activations = 6 * 1024 * (256 + 1024 + 1024) * 4  # what the blocks save, roughly
    (plain_held, plain_peak), (disk_held, disk_peak) = results["plain"], results["disk"]
    assert disk_held < plain_held - activations // 2, results
    assert disk_peak < plain_peak, results
    print("held/peak bytes after forward:", results)


STAND_IN = {
    # torchtune 0.6's layout: the names live in training/_activation_offloading.py and training/
    # re-exports them; the stand-in's manager fails as the real one does on CPU
    "torchtune/__init__.py": "",
    "torchtune/training/__init__.py": "from ._activation_offloading import (NoOpManager, OffloadActivations,\n"
                                      "    get_act_offloading_ctx_manager)\n",
    "torchtune/training/_activation_offloading.py": (
        "class OffloadActivations:\n"
        "    def __init__(self, *args, **kwargs):\n"
        "        raise AssertionError('Torch not compiled with CUDA enabled')\n"
        "class NoOpManager:\n    pass\n"
        "def get_act_offloading_ctx_manager(model, enable_activation_offloading):\n"
        "    return OffloadActivations()\n"),
}


def test_installed_torchtune_gets_both_of_its_names_replaced_and_restored(tmp_path) -> None:
    """torchtune installed: acshim.install() replaces the offloading names in the module and in
    torchtune.training's copies (what recipes call), and uninstall() gives the originals back."""
    for name, text in STAND_IN.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    code = """
import torch, acshim
from torch import nn
from torchtune import training
from torchtune.training import _activation_offloading as upstream
originals = (training.OffloadActivations, training.get_act_offloading_ctx_manager, upstream.NoOpManager)
acshim.install(dialects=["torchtune"])
from acshim.facades.torchtune.training import OffloadActivations, get_act_offloading_ctx_manager
assert training.OffloadActivations is OffloadActivations and upstream.OffloadActivations is OffloadActivations
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
x = torch.randn(4, 8, requires_grad=True)
model(x).square().sum().backward()
reference = [x.grad.clone(), *(p.grad.clone() for p in model.parameters())]
x.grad = None
model.zero_grad(set_to_none=True)
with training.get_act_offloading_ctx_manager(model, True):
    y = model(x)
y.square().sum().backward()
assert all(torch.equal(a, b) for a, b in zip([x.grad, *(p.grad for p in model.parameters())], reference))
acshim.uninstall()
assert (training.OffloadActivations, training.get_act_offloading_ctx_manager, upstream.NoOpManager) == originals
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr
