"""Megatron-core 0.16: ``fine_grained_activation_offloading`` with ``offload_modules`` on a
``GPTModel``, on CPU, beside selective recompute of each MLP.

``GPTModel.forward`` starts the offload chunk itself; the layers' ``attn_norm`` / ``mlp_norm``
inputs (tensors of at least ``min_offloaded_tensor_size`` elements) are what is offloaded. Under
``acshim run`` they go to acshim's storage tier: ``ACSHIM_OFFLOAD_STORAGE=disk`` sends them to disk,
the default host tier leaves CPU tensors where they are (upstream's offloader builds CUDA streams
and cannot run on CPU at all). The layers hold the norms and an MLP, no attention: Megatron's
attention needs a GPU. Needs ``pip install megatron-core==0.16.1``.

Run with ``ACSHIM_OFFLOAD_STORAGE=disk acshim run --report examples/megatron_core_offload.py
[--no-checkpointing]`` (``--no-checkpointing``: neither offloading nor recompute, the same gradients).
"""

import argparse
import hashlib
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

parser = argparse.ArgumentParser()
parser.add_argument("--no-checkpointing", action="store_true")
args = parser.parse_args()

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29533")
dist.init_process_group("gloo", rank=0, world_size=1)
parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
tensor_parallel.model_parallel_cuda_manual_seed(1234)

offload = {} if args.no_checkpointing else dict(
    fine_grained_activation_offloading=True, offload_modules=["attn_norm", "mlp_norm"],
    min_offloaded_tensor_size=1024, recompute_granularity="selective", recompute_modules=["mlp"])
config = TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=4, hidden_dropout=0.1,
                           use_cpu_initialization=True, **offload)
local = get_gpt_layer_local_spec().submodules
norm_mlp_layer = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
    input_layernorm=local.input_layernorm, pre_mlp_layernorm=local.pre_mlp_layernorm, mlp=local.mlp,
    mlp_bda=local.mlp_bda))
model = GPTModel(config, norm_mlp_layer, vocab_size=128, max_sequence_length=64)

torch.manual_seed(0)
tokens = torch.randint(0, 128, (2, 64))
positions = torch.arange(64).expand(2, 64)
for _ in range(2):
    model(tokens, positions, None, labels=tokens).float().mean().backward()

digest = hashlib.sha256()
for name, parameter in sorted(model.named_parameters()):
    digest.update(name.encode())
    digest.update(parameter.grad.numpy().tobytes())
dist.destroy_process_group()
print("GRADS", digest.hexdigest())
