"""PyTorch: ``apply_activation_checkpointing`` with ``checkpoint_wrapper`` (both implementations) on a
small transformer-style model, an ``auto_wrap_policy``, and ``offload_wrapper`` on a block.

Run with ``acshim run examples/torch_apply_activation_checkpointing.py [--no-checkpointing]``.
"""

import argparse
import functools
import hashlib

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
    offload_wrapper,
)
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

parser = argparse.ArgumentParser()
parser.add_argument("--no-checkpointing", action="store_true")
args = parser.parse_args()


class Attention(nn.Module):
    def __init__(self, width=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x, mask=None):
        batch, length, width = x.shape
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        y = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.1)
        return self.out(y.transpose(1, 2).reshape(batch, length, width))


class Layer(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = Attention(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(0.1))

    def forward(self, x, mask=None):
        x = x + self.attn(self.norm1(x), mask=mask)
        return x + self.mlp(self.norm2(x))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.layers = nn.ModuleList(Layer() for _ in range(4))
        self.head = nn.Linear(32, 64)

    def forward(self, ids):
        mask = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril()
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, mask=mask)
        return self.head(x)


torch.manual_seed(0)
model = Model()
if not args.no_checkpointing:
    # Layers 0-1 by check_fn (non-reentrant, the default); the MLPs of layers 2-3 by an FSDP policy,
    # reentrant; the attention of layer 3 offloaded.
    apply_activation_checkpointing(model.layers[:2], check_fn=lambda m: isinstance(m, Layer))
    apply_activation_checkpointing(
        model.layers[2:],
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.REENTRANT),
        auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}),
    )
    model.layers[3].attn = offload_wrapper(model.layers[3].attn)

torch.manual_seed(1)
ids = torch.randint(0, 64, (2, 16))
logits = model(ids)
loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 64), ids[:, 1:].reshape(-1))
loss.backward()
print(f"loss {loss.item():.6f}")

digest = hashlib.sha256()
for _, param in model.named_parameters():
    if param.grad is not None:
        digest.update(param.grad.detach().to(torch.float32).contiguous().numpy().tobytes())
print(f"GRADS {digest.hexdigest()}")
