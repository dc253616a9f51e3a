"""One rank of a tensor-parallel group of 2 (gloo, CPU): a Megatron-core 0.16.1 ``TransformerBlock``
of MLP layers (tensor-parallel fc1/fc2; attention needs a GPU) with full uniform recompute, one
training step with ``distribute_saved_activations`` False and True, under ``acshim.install()``.

Prints ``RESULT {json}``: whether the gradients are bitwise equal, the bytes each rank held for
backward (``acshim.measure_memory``, a barrier and a collection first so nothing transient counts),
the bytes of each saved shard against its full input (recorded by wrapping ``acshim.partition.Shard``),
the block input's shape after forward and after backward, and the error for an input that does not
split across the ranks.
"""

from __future__ import annotations

import gc
import json

import torch
import torch.distributed as dist

dist.init_process_group("gloo")

import acshim  # noqa: E402

acshim.install(dialects=["megatron"])

from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402
from megatron.core.transformer.transformer_block import TransformerBlock  # noqa: E402
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules  # noqa: E402

import acshim.partition as partition  # noqa: E402

TP = 2
parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
LOCAL = get_gpt_layer_local_spec().submodules
SPEC = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
    pre_mlp_layernorm=LOCAL.pre_mlp_layernorm, mlp=LOCAL.mlp, mlp_bda=LOCAL.mlp_bda))
SHARDS: list[list[int]] = []
_shard_init = partition.Shard.__init__


def _recording_init(self, tensor, *args, **kwargs) -> None:
    _shard_init(self, tensor, *args, **kwargs)
    SHARDS.append([self.data.numel() * self.data.element_size(), tensor.numel() * tensor.element_size()])


partition.Shard.__init__ = _recording_init


def settled_loss(output: torch.Tensor) -> torch.Tensor:
    dist.barrier(group=parallel_state.get_tensor_model_parallel_group())
    gc.collect()
    return output.float().pow(2).mean()


def step(distribute: bool) -> dict:
    SHARDS.clear()
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=4, hidden_dropout=0.1,
                               use_cpu_initialization=True, tensor_model_parallel_size=TP,
                               recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
                               distribute_saved_activations=distribute)
    block = TransformerBlock(config, SPEC)
    torch.manual_seed(0)
    leaf = torch.randn(64, 2, 64, requires_grad=True)
    hidden = leaf * 1.0  # what an embedding hands the block: not a leaf
    shapes = []
    block.register_forward_hook(lambda *_: shapes.append(list(hidden.shape)))
    report = acshim.measure_memory(block, {"hidden_states": hidden, "attention_mask": None}, loss_fn=settled_loss)
    shapes.append(list(hidden.shape))
    grads = [p.grad for _, p in sorted(block.named_parameters())] + [leaf.grad]
    return {"grads": grads, "held": report.held_bytes, "shards": list(SHARDS), "shapes": shapes}


plain, distributed = step(False), step(True)
try:
    tensor_parallel.checkpoint(lambda x: x * 2, True, torch.randn(3, requires_grad=True) * 1.0)
    uneven = None
except ValueError as error:  # 3 elements do not split across 2 ranks
    uneven = str(error)
print("RESULT", json.dumps({
    "rank": dist.get_rank(), "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
    "bitwise": all(torch.equal(a, b) for a, b in zip(distributed["grads"], plain["grads"])),
    "held": {"plain": plain["held"], "distributed": distributed["held"]},
    "shards": {"plain": plain["shards"], "distributed": distributed["shards"]},
    "shapes": distributed["shapes"], "uneven": uneven,
}), flush=True)
dist.destroy_process_group()
