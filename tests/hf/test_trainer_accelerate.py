"""Trainer's checkpointing arguments and Accelerate's FSDP activation checkpointing on the engine."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import transformers

import acshim.hf as hf
from acshim.hf.region import EngineCheckpointFunction
from acshim.testing import assert_bitwise_equal, hf_inputs, hf_model, train_step


def _losses(tmp_path, name, **checkpointing):
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(3))]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / name), per_device_train_batch_size=2, max_steps=4, learning_rate=1e-3,
        logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0, dataloader_num_workers=0,
        disable_tqdm=True, **checkpointing)
    trainer = transformers.Trainer(model=hf_model("gpt2"), args=args, train_dataset=data)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, trainer.model


def test_trainer_gradient_checkpointing_matches_loss_curve(tmp_path, installed):
    expected, _ = _losses(tmp_path, "plain")
    actual, model = _losses(tmp_path, "gc", gradient_checkpointing=True,
                            gradient_checkpointing_kwargs={"use_reentrant": True, "every_n_layers": 2})
    assert len(expected) == 4 and actual == expected
    function = model.transformer.h[0]._gradient_checkpointing_func
    assert isinstance(function, EngineCheckpointFunction) and function.options.reentrant
    assert [block.gradient_checkpointing for block in model.transformer.h] == [True, False, True]


def test_single_process_accelerator_trains_autopatched_model_exactly(autopatched):
    accelerate = pytest.importorskip("accelerate")
    expected = train_step(hf_model("llama"), hf_inputs("llama"))
    accelerator = accelerate.Accelerator(cpu=True)
    model = autopatched(lambda: hf_model("llama"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    torch.manual_seed(1)
    loss = model(**hf_inputs("llama")).loss
    accelerator.backward(loss)
    actual = {"loss": loss.detach(), **{f"grad:{n}": p.grad for n, p in model.named_parameters() if p.grad is not None}}
    expected = {k: v for k, v in expected.items() if not k.startswith("buffer:")}
    assert_bitwise_equal(expected, actual)


def test_fsdp2_apply_ac_is_replaced_and_restored(installed):
    pytest.importorskip("accelerate")
    import accelerate.accelerator
    import accelerate.utils.fsdp_utils

    assert accelerate.accelerator.fsdp2_apply_ac is hf.fsdp2_apply_ac
    assert accelerate.utils.fsdp_utils.fsdp2_apply_ac is hf.fsdp2_apply_ac
    hf.uninstall()
    assert accelerate.accelerator.fsdp2_apply_ac is not hf.fsdp2_apply_ac
    assert accelerate.utils.fsdp_utils.fsdp2_apply_ac.__module__ == "accelerate.utils.fsdp_utils"


# Accelerate selects DistributedType.FSDP only for accelerator device types (state.py: MULTI_GPU,
# MULTI_NPU, MULTI_XPU...); on a CPU-only machine Accelerator(fsdp_plugin=...) silently falls back to
# DistributedType.NO. So this drives the same calls Accelerator._prepare_fsdp2 makes - the module-level
# name accelerate.accelerator.fsdp2_apply_ac, then fully_shard - on a one-rank gloo group.
FSDP2_SCRIPT = textwrap.dedent("""
import os, sys, torch, warnings
warnings.simplefilter("ignore")
from types import SimpleNamespace
import acshim.hf as hf
hf.install()
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
import accelerate.accelerator
from accelerate.utils import FullyShardedDataParallelPlugin
from acshim.testing import hf_model, hf_inputs, train_step
dist.init_process_group("gloo", init_method="file://" + os.path.abspath("rendezvous"), rank=0, world_size=1)
expected = train_step(hf_model("llama"), hf_inputs("llama"))
full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t
for offload in (False, True):
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, activation_checkpointing=True,
                                            activation_checkpointing_offload=offload, auto_wrap_policy="transformer_based_wrap")
    accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin))
    model = hf_model("llama")
    plugin.set_auto_wrap_policy(model)
    model = accelerate.accelerator.fsdp2_apply_ac(accelerator, model)  # the name Accelerator._prepare_fsdp2 calls
    print("OFFLOAD", offload, "REGIONS", hf.acshim_regions(model))
    print("OFFLOAD", offload, "SCOPE", type(model.model.layers[0].forward.options.saved_tensors_scope).__name__)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    actual = train_step(model, hf_inputs("llama"))
    same = expected.keys() == actual.keys() and all(torch.equal(full(actual[k]), v) for k, v in expected.items())
    print("OFFLOAD", offload, "EQUAL", same)
# HF gradient_checkpointing_enable() and Accelerate's activation_checkpointing flag together: each
# block is still one region, computed twice per step (forward, one recompute), never three times.
plugin = FullyShardedDataParallelPlugin(fsdp_version=2, activation_checkpointing=True,
                                        auto_wrap_policy="transformer_based_wrap")
model = hf_model("llama")
model.gradient_checkpointing_enable()
plugin.set_auto_wrap_policy(model)
model = accelerate.accelerator.fsdp2_apply_ac(SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin)), model)
print("BOTH REGIONS", hf.acshim_regions(model))
for layer in model.model.layers:
    fully_shard(layer)
fully_shard(model)
calls = []
for layer in model.model.layers:
    layer.self_attn.register_forward_hook(lambda *args: calls.append(1))
actual = train_step(model, hf_inputs("llama"))
same = expected.keys() == actual.keys() and all(torch.equal(full(actual[k]), v) for k, v in expected.items())
print("BOTH ATTENTION CALLS", len(calls), "EQUAL", same)
dist.destroy_process_group()
""")


def test_fsdp2_activation_checkpointing_on_gloo_goes_through_engine(tmp_path):
    """With and without activation_checkpointing_offload, in one subprocess (process group)."""
    pytest.importorskip("accelerate")
    result = subprocess.run([sys.executable, "-c", FSDP2_SCRIPT], capture_output=True, text=True, timeout=300,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    for offload in (False, True):
        assert f"OFFLOAD {offload} REGIONS ['model.layers.0', 'model.layers.1', 'model.layers.2']" in result.stdout
        assert f"OFFLOAD {offload} EQUAL True" in result.stdout, result.stdout
    assert "OFFLOAD True SCOPE BoundaryOffload" in result.stdout and "OFFLOAD False SCOPE NoneType" in result.stdout
    assert "BOTH REGIONS ['model.layers.0', 'model.layers.1', 'model.layers.2']" in result.stdout
    assert "BOTH ATTENTION CALLS 6 EQUAL True" in result.stdout, result.stdout


def test_torch_checkpoint_wrapper_over_hf_gradient_checkpointing_recomputes_each_block_once():
    """Accelerate's FSDP1 path (torch's apply_activation_checkpointing, served by the PyTorch facade)
    on a model whose gradient_checkpointing_enable() already made its blocks regions: the nested
    region runs plainly inside the outer one, so each block computes twice per step, not three times."""
    import acshim
    from acshim.region import STATS

    expected = train_step(hf_model("llama"), {**hf_inputs("llama"), "use_cache": False})
    acshim.install()
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        model = hf_model("llama")
        model.gradient_checkpointing_enable()
        apply_activation_checkpointing(model, check_fn=lambda module: type(module).__name__ == "LlamaDecoderLayer")
        calls = []
        for name, module in model.named_modules():
            if name.endswith("self_attn"):
                module.register_forward_hook(lambda *args: calls.append(1))
        before = STATS.recomputes
        actual = train_step(model, hf_inputs("llama"))
    finally:
        acshim.uninstall()
    assert len(calls) == 2 * 3, "each of the 3 blocks: one forward and one recompute"
    assert STATS.recomputes > before, "the blocks must run on acshim's engine"
    assert_bitwise_equal(expected, {k.replace("_checkpoint_wrapped_module.", ""): v for k, v in actual.items()})


NO_CHECKPOINTING_SCRIPT = textwrap.dedent("""
    import torch, transformers
    config = transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, n_positions=64, vocab_size=128,
                                     bos_token_id=0, eos_token_id=1)
    model = transformers.GPT2LMHeadModel(config)
    print("REGIONS", [n for n, m in model.named_modules() if type(m.__dict__.get("forward")).__name__ == "HFBlockForward"])
""")


def test_acshim_run_hf_checkpoints_a_script_that_never_mentions_checkpointing(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(NO_CHECKPOINTING_SCRIPT)
    result = subprocess.run([sys.executable, "-m", "acshim", "run", "--hf", str(script)], capture_output=True,
                            text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "REGIONS ['transformer.h.0', 'transformer.h.1', 'transformer.h.2']" in result.stdout, result.stdout
