"""FairScale: ``checkpoint_wrapper`` on each block of a small conv net with BatchNorm and dropout,
keyword arguments, a non-tensor output, one block offloaded, and a frozen stem.

Run with ``acshim run examples/fairscale_checkpoint_wrapper.py [--no-checkpointing]``.
"""

import argparse
import hashlib

import torch
import torch.nn as nn
from fairscale.nn.checkpoint import checkpoint_wrapper, is_recomputing

parser = argparse.ArgumentParser()
parser.add_argument("--no-checkpointing", action="store_true")
args = parser.parse_args()


class Block(nn.Module):
    def __init__(self, channels=8):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = nn.BatchNorm2d(channels)
        self.drop = nn.Dropout(0.1)
        self.calls = 0

    def forward(self, x, scale=1.0):
        if not is_recomputing():
            self.calls += 1  # a side effect that must happen once per step
        return x + scale * self.drop(torch.relu(self.norm(self.conv(x)))), self.calls


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x, _ = block(x, scale=0.5)
        return self.head(x.mean(dim=(2, 3)))


torch.manual_seed(0)
model = Net()
model.stem.requires_grad_(False)
if not args.no_checkpointing:
    checkpoint_wrapper(model.stem)
    for index, block in enumerate(model.blocks):
        checkpoint_wrapper(block, offload_to_cpu=index == 1)

torch.manual_seed(1)
data, target = torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
loss = nn.functional.cross_entropy(model(data), target)
loss.backward()
assert all(block.calls == 1 for block in model.blocks)
print(f"loss {loss.item():.6f} running_mean {model.blocks[0].norm.running_mean.sum().item():.6f}")

digest = hashlib.sha256()
for _, param in model.named_parameters():
    if param.grad is not None:
        digest.update(param.grad.detach().to(torch.float32).contiguous().numpy().tobytes())
print(f"GRADS {digest.hexdigest()}")
