"""TRL's activation offloading (``trl.models.get_act_offloading_ctx_manager``, ``OffloadActivations``,
``NoOpManager``; TRL 1.16, what ``SFTConfig(activation_offloading=True)`` calls) served by
``acshim.offload``: TRL's arguments and errors, the head kept out as TRL keeps it, gradients bitwise
equal to no offloading, and a real ``SFTTrainer`` run under ``acshim run`` (where TRL's own manager
fails on CPU) with weights bitwise equal and, on the disk tier, a lower RSS peak."""

from __future__ import annotations

import inspect
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import acshim
from acshim.facades.trl.models import activation_offloading as facade
from acshim.storage import reset_defaults

REPO = Path(__file__).resolve().parents[2]
TESTED_TRL = "1.16"
"""The TRL release these tests pin (pyproject's ``finetune`` extra)."""


@pytest.fixture(autouse=True)
def _fresh_defaults():
    reset_defaults()
    yield
    reset_defaults()


class Model(nn.Module):
    """A Hugging Face layout: blocks, then ``lm_head``."""

    def __init__(self, width: int = 64, layers: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, 4 * width), nn.Dropout(0.1), nn.GELU(),
                                                  nn.Linear(4 * width, width)) for _ in range(layers))
        self.lm_head = nn.Linear(width, 100)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return self.lm_head(x)


def _step(model, x, ctx):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    with ctx:
        logits = model(x)
    logits.square().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _parameters(function) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


def test_signature_arguments_and_errors_are_trls() -> None:
    trl_offloading = pytest.importorskip("trl.models.activation_offloading")
    import trl

    assert trl.__version__.startswith(TESTED_TRL), f"tests pin TRL {TESTED_TRL}, found {trl.__version__}"
    # a newer TRL that renames or adds an argument fails here instead of passing silently
    for name in ("OffloadActivations", "get_act_offloading_ctx_manager"):
        upstream = getattr(trl_offloading, name)
        upstream = getattr(upstream, "__wrapped__", upstream)
        assert _parameters(upstream) == _parameters(getattr(facade, name)), name
    manager = facade.OffloadActivations(use_pin_memory=False, use_streams=False, min_offload_size=4096,
                                        max_fwd_stash_size=0)
    assert isinstance(manager, acshim.storage.OffloadActivations)
    assert manager.options.min_bytes == manager.min_tensor_size_bytes == 4096
    with pytest.raises(ValueError, match="max_fwd_stash_size should be at least 1 but is 0"):
        facade.OffloadActivations(use_streams=True, max_fwd_stash_size=0)


def test_trl_switch_offloads_all_but_the_head_on_disk_exactly(tmp_path, monkeypatch) -> None:
    x = torch.randn(32, 64)
    expected = _step(Model(), x, torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    monkeypatch.setenv("ACSHIM_OFFLOAD_STORAGE", "disk")
    monkeypatch.setenv("ACSHIM_OFFLOAD_DIR", str(tmp_path))
    model = Model()
    manager = facade.get_act_offloading_ctx_manager(model, use_pin_memory=False, use_streams=False)
    assert manager.options.storage == "disk" and manager.options.directory == str(tmp_path)
    for _ in range(2):  # SFTTrainer enters the same manager every step
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
    manager = facade.OffloadActivations(min_offload_size=0)
    with manager:
        with facade.NoOpManager():
            (x @ w).tanh()
    assert manager.stats.moved == 0 and manager.stats.saved == 0


def test_head_search_follows_trl_peft_wrappers_final_norm_and_liger(caplog) -> None:
    class Peft(nn.Module):  # PeftModel's shape: .base_model and .peft_config
        def __init__(self) -> None:
            super().__init__()
            self.base_model = Model()
            self.peft_config = {}

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = Peft()

    model = Wrapped()
    facade.get_act_offloading_ctx_manager(model)
    assert model.module.base_model.lm_head._forward_pre_hooks and model.module.base_model.lm_head._forward_hooks

    norm = nn.Module()
    norm.blocks, norm.ln_f, norm.liger_rms = nn.Linear(4, 4), nn.LayerNorm(4), nn.LayerNorm(4)
    facade.get_act_offloading_ctx_manager(norm)
    assert norm.ln_f._forward_pre_hooks and norm.liger_rms._forward_pre_hooks and not norm.blocks._forward_pre_hooks

    with caplog.at_level(logging.WARNING, logger="trl.models.activation_offloading"):
        facade.get_act_offloading_ctx_manager(nn.Sequential(nn.Linear(4, 4)), warn_if_no_head=False)
        assert not caplog.records
        facade.get_act_offloading_ctx_manager(nn.Sequential(nn.Linear(4, 4)))
    assert "no output head was detected" in caplog.text and "warn_if_no_head=False" in caplog.text


def test_installed_trl_names_replaced_for_the_trainers_and_restored() -> None:
    """TRL installed: ``acshim.install()`` replaces the three names in
    ``trl.models.activation_offloading`` and the copy ``trl.trainer.sft_trainer`` took, and
    ``uninstall()`` gives the originals back (a subprocess: the patches are process-wide)."""
    pytest.importorskip("trl")
    code = """
import acshim
from trl.models import activation_offloading as upstream
from trl.trainer import sft_trainer
originals = (upstream.OffloadActivations, upstream.NoOpManager, sft_trainer.get_act_offloading_ctx_manager)
acshim.install(dialects=["trl"])
from acshim.facades.trl.models import activation_offloading as facade
assert upstream.OffloadActivations is facade.OffloadActivations and upstream.NoOpManager is facade.NoOpManager
manager = sft_trainer.get_act_offloading_ctx_manager(__import__("torch").nn.Linear(2, 2), warn_if_no_head=False)
assert isinstance(manager, facade.OffloadActivations)
acshim.uninstall()
assert (upstream.OffloadActivations, upstream.NoOpManager, sft_trainer.get_act_offloading_ctx_manager) == originals
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr


SFT_ARGS = ["--max_steps", "2", "--per_device_train_batch_size", "4", "--report_to", "none", "--seed", "3",
            "--save_strategy", "no", "--max_length", "256", "--dataloader_num_workers", "0", "--bf16", "False",
            "--use_cpu", "True", "--disable_tqdm", "True", "--learning_rate", "1e-3", "--gradient_checkpointing", "False"]


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc to measure RSS")
def test_sft_config_activation_offloading_trains_exactly_under_acshim_run_and_disk_lowers_rss(tmp_path) -> None:
    """TRL's own ``sft.py`` shape with ``--activation_offloading True`` (TRL's manager raises on CPU):
    under ``acshim run --report`` with ``ACSHIM_OFFLOAD_STORAGE=disk`` the weights after two steps are
    bitwise those of the run without offloading, the RSS peak of the second step is lower, and the
    report names TRL as the API that offloaded."""
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    from safetensors.torch import load_file

    from acshim.testing import write_finetuning_fixture

    write_finetuning_fixture(str(tmp_path), vocab=1000, hidden=256, layers=4, rows=8, words=255)
    probe = REPO / "tests" / "hf" / "scripts" / "rss_probe.py"
    script = REPO / "examples" / "finetuning" / "trl_sft.py"
    results = {}
    for name, prefix, offload in (("plain", [], "False"), ("disk", ["-m", "acshim", "run", "--report"], "True")):
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "datasets"),
                   TOKENIZERS_PARALLELISM="false", MALLOC_MMAP_THRESHOLD_="65536", RSS_PROBE_FROM_STEP="2",
                   OMP_NUM_THREADS="1", ACSHIM_OFFLOAD_STORAGE="disk", ACSHIM_OFFLOAD_DIR=str(tmp_path))
        command = [sys.executable, *prefix, str(probe), str(script), "--model_name_or_path", str(tmp_path / "model"),
                   "--dataset_name", str(tmp_path / "data"), "--output_dir", str(tmp_path / name),
                   "--activation_offloading", offload, *SFT_ARGS]
        done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]
        line = [line for line in done.stdout.splitlines() if line.startswith("RSS ")][-1]
        results[name] = {"peak": json.loads(line[4:])["peak"], "out": done.stdout + done.stderr}
    reference = load_file(tmp_path / "plain" / "model.safetensors")
    got = load_file(tmp_path / "disk" / "model.safetensors")
    assert set(got) == set(reference) and all(torch.equal(got[k], reference[k]) for k in got)
    assert any(not torch.equal(got[k], load_file(tmp_path / "model" / "model.safetensors")[k]) for k in got)
    offloaded = [line for line in results["disk"]["out"].splitlines() if "moved, prefetch hits" in line]
    assert any(line.split()[0] == "disk" and line.rstrip().endswith("by trl") for line in offloaded), offloaded
    # measured 39.3 MB against 115.2 MB (gradient checkpointing off, so offloading is all that differs)
    assert results["disk"]["peak"] < 0.6 * results["plain"]["peak"], {k: v["peak"] for k, v in results.items()}
    print("RSS peak of step 2 (bytes):", {k: v["peak"] for k, v in results.items()})
