"""Megatron-core 0.16: ``TransformerConfig``'s recompute keys on a ``TransformerBlock``, on CPU.

Megatron's own config validation and layer choice (``recompute_method='uniform'``, chunks of
``recompute_num_layers`` layers) decide what is recomputed; under ``acshim run`` each
``tensor_parallel.checkpoint`` is an acshim region and ``model_parallel_cuda_manual_seed`` seeds
acshim's RNG tracker, which is what lets this run on CPU at all (upstream reads ``torch.cuda``).
The layers hold an MLP only: Megatron's attention allocates its buffer on ``torch.cuda`` and
needs a GPU. Needs ``pip install megatron-core==0.16.1``.

Run with ``acshim run examples/megatron_core_recompute.py [--no-checkpointing]``.
"""

import argparse
import hashlib
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

parser = argparse.ArgumentParser()
parser.add_argument("--no-checkpointing", action="store_true")
args = parser.parse_args()

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29531")
dist.init_process_group("gloo", rank=0, world_size=1)
parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
tensor_parallel.model_parallel_cuda_manual_seed(1234)

recompute = {} if args.no_checkpointing else dict(
    recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2)
config = TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4, hidden_dropout=0.1,
                           use_cpu_initialization=True, **recompute)
local = get_gpt_layer_local_spec().submodules
mlp_layer = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
    pre_mlp_layernorm=local.pre_mlp_layernorm, mlp=local.mlp, mlp_bda=local.mlp_bda))
block = TransformerBlock(config, mlp_layer)

torch.manual_seed(0)
hidden = torch.randn(16, 2, 32, requires_grad=True)  # [sequence, batch, hidden]
for _ in range(2):
    block(hidden, attention_mask=None).float().pow(2).mean().backward()

digest = hashlib.sha256()
for name, parameter in sorted(block.named_parameters()):
    digest.update(name.encode())
    digest.update(parameter.grad.numpy().tobytes())
digest.update(hidden.grad.numpy().tobytes())
dist.destroy_process_group()
print("GRADS", digest.hexdigest())
