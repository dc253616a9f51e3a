"""Megatron-core 0.16.1's ``fine_grained_activation_offloading`` / ``offload_modules`` on acshim's
storage tier, in place under ``acshim.install()``, on CPU (gloo, TP=1).

Upstream's offloader builds CUDA streams when first used, so it cannot run here at all. Under acshim
a real ``GPTModel`` (whose forward calls ``init_chunk_handler``) and a bare ``TransformerBlock``
(the chunk started by hand, as ``GPTModel`` does) with ``offload_modules`` ``attn_norm`` /
``mlp_norm`` train with gradients bitwise equal to no offloading (dropout on); on the disk tier
``acshim.measure_memory`` holds less. The layers run without attention (it needs a GPU), so the
other entries (``qkv_linear``, ``core_attn``, ``attn_proj``, ``expert_fc1``, ``moe_act``) are only
validated here. Each case set runs in a fresh interpreter (``parallel_state`` is process-wide).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="absent upstream: megatron-core is not installed (pip install 'acshim[megatron]')")

REPO = Path(__file__).resolve().parents[2]
OFFLOAD_MODULES = {"attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act"}
SEQUENCE, BATCH, HIDDEN, LAYERS = 64, 2, 64, 4
INPUT_BYTES = SEQUENCE * BATCH * HIDDEN * 4  # one norm's fp32 input

WORKER = r"""
import json, os, sys, torch
import torch.distributed as dist
dist.init_process_group("gloo", rank=0, world_size=1)
import acshim
acshim.install(dialects=["megatron"])
from acshim.facades.megatron import _fine_grained
from acshim.storage.defaults import get_defaults
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
    FineGrainedActivationOffloadingInterface as off_interface)
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
parallel_state.initialize_model_parallel(1, 1)
S, B, H, L = json.loads(sys.argv[2])
local = get_gpt_layer_local_spec().submodules
SPEC = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(  # no attention: it needs a GPU
    input_layernorm=local.input_layernorm, pre_mlp_layernorm=local.pre_mlp_layernorm, mlp=local.mlp,
    mlp_bda=local.mlp_bda))

def config(keys):
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    return TransformerConfig(num_layers=L, hidden_size=H, num_attention_heads=4, hidden_dropout=0.1,
                             use_cpu_initialization=True, **keys)

def block_step(keys, chunk, keep_input):
    cfg = config(keys)
    block = TransformerBlock(cfg, SPEC)
    off_interface.reset_instance()
    if chunk:  # what GPTModel.preprocess_for_fine_grained_offloading does first
        off_interface.init_chunk_handler(vp_size=None, vp_stage=None,
                                         min_offloaded_tensor_size=cfg.min_offloaded_tensor_size)
    torch.manual_seed(0)
    leaf = torch.randn(S, B, H, requires_grad=True)
    hidden = leaf * 1.0  # a leaf is alive anyway and never moves; an embedding's output is not one
    if keep_input:
        off_interface.mark_not_offloadable(hidden)
    report = acshim.measure_memory(block, {"hidden_states": hidden, "attention_mask": None},
                                   loss_fn=lambda out: out.float().pow(2).mean())
    grads = [p.grad for _, p in sorted(block.named_parameters())] + [leaf.grad]
    return grads, report.held_bytes

def gpt_step(keys):
    model = GPTModel(config(keys), SPEC, vocab_size=128, max_sequence_length=S)
    off_interface.reset_instance()
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (B, S))
    model(ids, torch.arange(S).expand(B, S), None, labels=ids).float().mean().backward()
    return [p.grad for _, p in sorted(model.named_parameters())]

def summary():
    chunks = _fine_grained.MANAGER.chunks
    return {"moved": _fine_grained.moved_bytes(), "groups": [c.groups for c in chunks],
            "origin": [c.scope.session.origin for c in chunks]}

out = {"interface": off_interface.__module__, "prefetch": get_defaults().prefetch, "cases": {}}
block_reference, held_reference = block_step({}, False, False)
gpt_reference = gpt_step({})
out["held_reference"] = held_reference
for name, case in json.loads(sys.argv[1]).items():
    os.environ["ACSHIM_OFFLOAD_STORAGE"] = case.get("storage", "disk")
    try:
        if case.get("gpt"):
            grads, held, reference = gpt_step(case["keys"]), None, gpt_reference
        else:
            (grads, held), reference = block_step(case["keys"], case.get("chunk", True), case.get("keep_input", False)), block_reference
    except Exception as error:
        out["cases"][name] = {"error": f"{type(error).__name__}: {error}"}
        continue
    out["cases"][name] = {"bitwise": all(torch.equal(a, b) for a, b in zip(grads, reference)), "held": held, **summary()}
print("RESULT", json.dumps(out))
"""


def _keys(*modules: str, min_size: int = 1024) -> dict:
    return {"fine_grained_activation_offloading": True, "offload_modules": list(modules),
            "min_offloaded_tensor_size": min_size}


CASES = {
    "mlp_norm_disk": {"keys": _keys("mlp_norm")},
    "attn_norm_disk": {"keys": _keys("attn_norm")},
    "both_disk": {"keys": _keys("attn_norm", "mlp_norm")},
    "both_host": {"keys": _keys("attn_norm", "mlp_norm"), "storage": "host"},
    "both_input_marked": {"keys": _keys("attn_norm", "mlp_norm"), "keep_input": True},
    "over_min_size": {"keys": _keys("attn_norm", "mlp_norm", min_size=SEQUENCE * BATCH * HIDDEN + 1)},
    "no_chunk": {"keys": _keys("attn_norm", "mlp_norm"), "chunk": False},
    "gpt_model_disk": {"keys": _keys("attn_norm", "mlp_norm"), "gpt": True},
    "both_full_recompute": {"keys": {**_keys("attn_norm", "mlp_norm"), "recompute_granularity": "full",
                                     "recompute_method": "uniform", "recompute_num_layers": 1}},
    "both_selective_mlp": {"keys": {**_keys("attn_norm", "mlp_norm"), "recompute_granularity": "selective",
                                    "recompute_modules": ["mlp"]}},
    "bogus_module": {"keys": _keys("bogus")},
    "empty_modules": {"keys": _keys()},
    "attn_proj_alone": {"keys": _keys("attn_proj")},
    "with_cpu_offloading": {"keys": {**_keys("mlp_norm"), "cpu_offloading": True}},
}


@pytest.fixture(scope="module")
def results() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACSHIM_", "PYTEST_"))}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29000 + os.getpid() % 300), OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", WORKER, json.dumps(CASES), json.dumps([SEQUENCE, BATCH, HIDDEN, LAYERS])],
                          env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, f"worker failed ({done.returncode}):\n{done.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def _ok(results: dict, name: str) -> dict:
    case = results["cases"][name]
    assert "error" not in case, case.get("error")
    assert case["bitwise"], f"{name}: gradients differ from no offloading"
    return case


def test_the_interface_is_acshims_in_place(results: dict) -> None:
    assert results["interface"] == "acshim.facades.megatron._fine_grained"


@pytest.mark.parametrize("name, groups, caller_held", [
    # caller_held: the first attn_norm's input is the block input, which the caller still holds
    ("mlp_norm_disk", ["mlp_norm"] * LAYERS, 0),
    ("attn_norm_disk", ["attn_norm"] * LAYERS, 1),
    ("both_disk", ["attn_norm", "mlp_norm"] * LAYERS, 1),
])
def test_offload_modules_send_each_listed_norms_input_to_the_disk_tier_bitwise_and_hold_less(
        results: dict, name: str, groups: list[str], caller_held: int) -> None:
    case = _ok(results, name)
    assert case["groups"] == [groups] and case["origin"] == ["megatron"]
    # each listed norm saved its [s, b, h] input (plus its per-token statistics) on the tier
    assert case["moved"] >= len(groups) * INPUT_BYTES
    # every group but the last `prefetch` ones (kept resident for backward) left memory
    freed = len(groups) - results["prefetch"] - caller_held
    assert case["held"] <= results["held_reference"] - freed * INPUT_BYTES


def test_a_real_gpt_model_starts_the_chunk_itself(results: dict) -> None:
    case = _ok(results, "gpt_model_disk")
    assert case["groups"] == [["attn_norm", "mlp_norm"] * LAYERS]
    assert case["moved"] >= 2 * LAYERS * SEQUENCE * BATCH * HIDDEN * 4


def test_upstreams_chunk_rule_size_floor_and_opt_out_are_kept(results: dict) -> None:
    both = _ok(results, "both_disk")
    assert _ok(results, "both_host")["moved"] == 0  # the host tier leaves CPU tensors where they are
    assert _ok(results, "no_chunk")["groups"] == []  # no init_chunk_handler: upstream offloads nothing
    floor = _ok(results, "over_min_size")
    assert floor["groups"] == both["groups"] and floor["moved"] == 0  # numel < min_offloaded_tensor_size stays
    marked = _ok(results, "both_input_marked")  # the first layer's norm input is the marked block input
    assert marked["moved"] == both["moved"] - INPUT_BYTES


@pytest.mark.parametrize("name", ["both_full_recompute", "both_selective_mlp"])
def test_offload_modules_compose_with_recompute_bitwise(results: dict, name: str) -> None:
    case = _ok(results, name)
    assert case["moved"] > 0  # the listed norms still go to the tier (under full recompute, in its recompute)


@pytest.mark.parametrize("name, error", [
    ("bogus_module", "AssertionError: Invalid choices for offload_modules: {'bogus'}"),
    ("empty_modules", "AssertionError"),
    ("attn_proj_alone", "ValueError: attn_proj cannot be set to offload_modules alone without core_attn"),
    ("with_cpu_offloading", "AssertionError: fine_grained_activation_offloading cannot be enabled with cpu_offloading."),
])
def test_invalid_offload_combinations_raise_upstreams_errors(results: dict, name: str, error: str) -> None:
    assert results["cases"][name]["error"].startswith(error)


def test_offload_modules_choices_are_pinned(results: dict) -> None:
    listed = results["cases"]["bogus_module"]["error"].split("Allowed modules are:")[1]
    assert {name.strip(" '{}.") for name in listed.split(",")} == OFFLOAD_MODULES


def test_example_under_acshim_run_report_names_megatron_on_the_disk_tier_bitwise() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACSHIM_", "PYTEST_"))}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(29900 + os.getpid() % 90), ACSHIM_OFFLOAD_STORAGE="disk")
    runs = {}
    for flags in ((), ("--no-checkpointing",)):
        done = subprocess.run([sys.executable, "-m", "acshim", "run", "--report", "examples/megatron_core_offload.py",
                               *flags], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[flags] = done
    offloaded, plain = runs[()], runs[("--no-checkpointing",)]
    assert offloaded.stdout.split("GRADS ")[-1] == plain.stdout.split("GRADS ")[-1]
    # two steps of 8 norm inputs (64 x 2 x 64 fp32, 32 KiB each) on disk, named after the dialect
    assert "disk   512.0 KiB moved" in offloaded.stderr and "by megatron" in offloaded.stderr
    assert "by megatron" not in plain.stderr
