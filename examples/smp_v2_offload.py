"""SageMaker model parallelism v2: PyTorch activation checkpointing plus ``offload_wrapper`` on the root,
configured through ``torch.sagemaker.init`` (the documented v2 pattern, in one process without FSDP).

Run with ``acshim run examples/smp_v2_offload.py [--no-checkpointing]``.
"""

import argparse
import functools
import hashlib

import torch
import torch.nn as nn
import torch.sagemaker as tsm
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
    offload_wrapper,
)
from torch.sagemaker.grad_norm import clip_grad_norm_

parser = argparse.ArgumentParser()
parser.add_argument("--no-checkpointing", action="store_true")
args = parser.parse_args()


class Layer(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.fc2(torch.relu(self.fc1(self.norm(x)))))


tsm.init({"sm_activation_offloading": True, "activation_loading_horizon": 2})
torch.manual_seed(0)
model = nn.Sequential(*[Layer() for _ in range(4)], nn.Linear(32, 1))
model = tsm.transform(model)
if not args.no_checkpointing:
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.REENTRANT),
        check_fn=lambda m: isinstance(m, Layer),
    )
    if tsm.state.sm_activation_offloading:
        model = offload_wrapper(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

data, target = torch.randn(8, 32), torch.randn(8, 1)
optimizer.zero_grad(set_to_none=True)
torch.manual_seed(1)
loss = nn.functional.mse_loss(model(data), target)
loss.backward()
clip_grad_norm_(model, 1.0)
print(f"loss {loss.item():.6f} rank {tsm.state.rank} tp {tsm.state.tensor_parallel_degree}")

digest = hashlib.sha256()
for _, param in model.named_parameters():
    if param.grad is not None:
        digest.update(param.grad.detach().to(torch.float32).contiguous().numpy().tobytes())
optimizer.step()
print(f"GRADS {digest.hexdigest()}")
