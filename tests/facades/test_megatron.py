"""Megatron-core 0.16.1 in place under ``acshim.install()``: ``TransformerConfig``'s recompute keys
keep upstream's validation and layer choice, each ``tensor_parallel.checkpoint`` is an acshim region,
and the RNG streams live in acshim's tracker, so a ``TransformerBlock`` of MLP layers trains on CPU
with gradients bitwise equal to no recompute (dropout on). Upstream alone cannot run there
(``model_parallel_cuda_manual_seed`` reads ``torch.cuda``); attention needs a GPU in any case
(its buffer is allocated on ``torch.cuda.current_device()``).

Each case runs in a fresh interpreter: Megatron's ``parallel_state`` and torch.distributed are
process-wide.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="absent upstream: megatron-core is not installed (pip install 'acshim[megatron]')")

REPO = Path(__file__).resolve().parents[2]

# Keys of megatron-core 0.16.1's TransformerConfig this facade's semantics rest on. A newer upstream
# that renames or drops one fails test_transformer_config_keeps_the_recompute_and_offload_keys.
RECOMPUTE_KEYS = {"recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules",
                  "distribute_saved_activations", "moe_layer_recompute"}
OFFLOAD_KEYS = {"cpu_offloading", "cpu_offloading_num_layers", "cpu_offloading_activations",
                "cpu_offloading_weights", "cpu_offloading_double_buffering", "fine_grained_activation_offloading",
                "offload_modules", "min_offloaded_tensor_size"}
RECOMPUTE_MODULES = {"core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts"}

WORKER = r"""
import json, os, sys, torch
import torch.distributed as dist
dist.init_process_group("gloo", rank=0, world_size=1)
import acshim
installation = acshim.install(dialects=["megatron"])
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from acshim.patching.inplace import is_acshim_wrapper
parallel_state.initialize_model_parallel(1, 1)
local = get_gpt_layer_local_spec().submodules
SPEC = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
    pre_mlp_layernorm=local.pre_mlp_layernorm, mlp=local.mlp, mlp_bda=local.mlp_bda))

def run(recompute):
    storage = recompute.pop("_storage", None)
    if storage:
        os.environ["ACSHIM_OFFLOAD_STORAGE"] = storage
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4, hidden_dropout=0.1,
                               use_cpu_initialization=True, **recompute)
    block = TransformerBlock(config, SPEC)
    calls = [[0, 0] for _ in block.layers]  # per layer: MLP forwards, pre-MLP norm forwards
    for i, layer in enumerate(block.layers):
        for j, module in enumerate((layer.mlp, layer.pre_mlp_layernorm)):
            module.register_forward_pre_hook(lambda *_, i=i, j=j: calls[i].__setitem__(j, calls[i][j] + 1))
    torch.manual_seed(0)
    hidden = torch.randn(16, 2, 32, requires_grad=True)
    block(hidden, attention_mask=None).float().pow(2).mean().backward()
    os.environ.pop("ACSHIM_OFFLOAD_STORAGE", None)
    moved = block.offload_context.moved_bytes() if hasattr(block.offload_context, "moved_bytes") else 0
    grads = [p.grad for _, p in sorted(block.named_parameters())] + [hidden.grad]
    return calls, grads, moved

_, reference, _ = run({})
cases = json.loads(sys.argv[1])
out = {"missing": installation.reports["megatron"].missing,
       "checkpoint_is_acshim": is_acshim_wrapper(tensor_parallel.checkpoint),
       "tracker": type(tensor_parallel.get_cuda_rng_tracker()).__module__, "cases": {}}
for name, recompute in cases.items():
    try:
        calls, grads, moved = run(recompute)
    except Exception as error:
        out["cases"][name] = {"error": f"{type(error).__name__}: {error}"}
        continue
    out["cases"][name] = {"calls": calls, "moved": moved,
                          "bitwise": all(torch.equal(a, b) for a, b in zip(grads, reference))}
print("RESULT", json.dumps(out))
"""

CASES = {
    "none": {},
    "full_uniform_1": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    "full_uniform_2": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2},
    "full_block_1": {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1},
    "full_block_3": {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 3},
    "selective_mlp": {"recompute_granularity": "selective", "recompute_modules": ["mlp"]},
    "selective_layernorm": {"recompute_granularity": "selective", "recompute_modules": ["layernorm"]},
    "selective_layernorm_mlp": {"recompute_granularity": "selective", "recompute_modules": ["layernorm", "mlp"]},
    "cpu_offloading_disk_2": {"cpu_offloading": True, "cpu_offloading_num_layers": 2, "_storage": "disk"},
    "cpu_offloading_host_2": {"cpu_offloading": True, "cpu_offloading_num_layers": 2, "_storage": "host"},
    "cpu_offloading_weights": {"cpu_offloading": True, "cpu_offloading_num_layers": 1,
                               "cpu_offloading_weights": True},
    "cpu_offloading_with_recompute": {"cpu_offloading": True, "cpu_offloading_num_layers": 1,
                                      "recompute_granularity": "full", "recompute_method": "uniform",
                                      "recompute_num_layers": 1},
    "full_without_method": {"recompute_granularity": "full"},
    "selective_with_num_layers": {"recompute_granularity": "selective", "recompute_method": "uniform",
                                  "recompute_num_layers": 1},
    "bogus_module": {"recompute_granularity": "selective", "recompute_modules": ["bogus"]},
}


@pytest.fixture(scope="module")
def results() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACSHIM_", "PYTEST_"))}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29600 + os.getpid() % 300), OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", WORKER, json.dumps(CASES)], env=env, capture_output=True,
                          text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, f"worker failed ({done.returncode}):\n{done.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def test_every_patched_megatron_name_exists_in_the_installed_version(results: dict) -> None:
    assert results["missing"] == []
    assert results["checkpoint_is_acshim"]
    assert results["tracker"] == "acshim.facades.megatron.core.tensor_parallel.random"


def test_transformer_config_keeps_the_recompute_and_offload_keys() -> None:
    from megatron.core.transformer import TransformerConfig

    fields = {field.name for field in dataclasses.fields(TransformerConfig)}
    assert RECOMPUTE_KEYS | OFFLOAD_KEYS <= fields, f"renamed or dropped upstream: {(RECOMPUTE_KEYS | OFFLOAD_KEYS) - fields}"
    with pytest.raises(AssertionError) as error:
        TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2, recompute_granularity="selective",
                          recompute_modules=["bogus"])
    listed = str(error.value).split("Allowed modules are:")[1]
    assert {name.strip(" '{}.") for name in listed.split(",")} == RECOMPUTE_MODULES


@pytest.mark.parametrize("name, calls", [
    # per layer: [MLP forwards, pre-MLP norm forwards] in one step
    ("none", [[1, 1]] * 4),
    ("full_uniform_1", [[2, 2]] * 4),                    # every layer, one region each
    ("full_uniform_2", [[2, 2]] * 4),                    # every layer, two layers per region
    ("full_block_1", [[2, 2]] + [[1, 1]] * 3),           # the first recompute_num_layers layers only
    ("full_block_3", [[2, 2]] * 3 + [[1, 1]]),
    ("selective_mlp", [[2, 1]] * 4),                     # the MLP of every layer
    ("selective_layernorm", [[1, 2]] * 4),               # the norm, its output discarded until the MLP's backward
    ("selective_layernorm_mlp", [[2, 2]] * 4),           # both, each its own region
])
def test_recompute_keys_choose_upstreams_layers_and_match_no_recompute_bitwise(results: dict, name: str,
                                                                                calls: list[int]) -> None:
    case = results["cases"][name]
    assert "error" not in case, case.get("error")
    assert case["calls"] == calls
    assert case["bitwise"]


@pytest.mark.parametrize("name, error", [
    ("full_without_method", 'ValueError: Using recompute_granularity: full so recompute_method must be "block" or '
                            '"uniform"'),
    ("cpu_offloading_weights", "ValueError: TransformerConfig(cpu_offloading_weights=True): weight offload is not "
                               "served by acshim"),
    ("cpu_offloading_with_recompute", "ValueError: CPU offloading does not work when activation recomputation is "
                                      "enabled"),
    ("selective_with_num_layers", "ValueError: When using recompute_granularity: selective recompute_num_layers "
                                  "must be None."),
    ("bogus_module", "AssertionError: Invalid choices for recompute_modules: {'bogus'}"),
])
def test_invalid_recompute_combinations_raise_upstreams_errors(results: dict, name: str, error: str) -> None:
    assert results["cases"][name]["error"].startswith(error)


def test_report_names_the_regions_megatron() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACSHIM_", "PYTEST_"))}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(29300 + os.getpid() % 300))
    done = subprocess.run([sys.executable, "-m", "acshim", "run", "--report", "examples/megatron_core_recompute.py"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # uniform, recompute_num_layers=2 on 4 layers: 2 regions, two steps
    assert "megatron                   2 region(s), 4 forwards, 4 recomputes" in done.stderr


def test_cpu_offloading_sends_the_first_layers_activations_to_the_storage_tier_bitwise(results: dict) -> None:
    disk, host = results["cases"]["cpu_offloading_disk_2"], results["cases"]["cpu_offloading_host_2"]
    for case in (disk, host):
        assert "error" not in case, case.get("error")
        assert case["bitwise"] and case["calls"] == [[1, 1]] * 4  # offload, no recompute
    # the disk tier moves what the first two layers saved (each saves at least its 16x2x32 fp32 input
    # to the norm and its 16x2x128 MLP activations); the host tier leaves CPU tensors where they are
    assert disk["moved"] >= 2 * (16 * 2 * 32 + 16 * 2 * 128) * 4
    assert host["moved"] == 0
