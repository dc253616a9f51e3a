"""SageMaker model parallelism v1: an nn.Sequential checkpointed with strategies (dev guide, example 2).

Part of the stack goes through ``checkpoint_sequential`` inside forward, the rest through
``smp.set_activation_checkpointing`` with a strategy. Run with
``acshim run examples/smp_v1_sequential_strategies.py [--no-checkpointing]``.
"""

import argparse
import hashlib

import smdistributed.modelparallel.torch as smp
import torch
import torch.nn as nn
from smdistributed.modelparallel.torch.patches.checkpoint import checkpoint_sequential

parser = argparse.ArgumentParser()
parser.add_argument("--no-checkpointing", action="store_true")
parser.add_argument("--strategy", default="group_2")
args = parser.parse_args()


def block(width):
    return nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Dropout(0.1), nn.Linear(2 * width, width))


class Net(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.encoder = nn.Sequential(*[block(width) for _ in range(4)])
        self.decoder = nn.Sequential(*[block(width) for _ in range(5)])
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        if args.no_checkpointing:
            x = self.encoder(x)
        else:
            x = checkpoint_sequential(self.encoder, x, strategy="each")
        return self.head(self.decoder(x))


smp.init({"partitions": 1, "microbatches": 2})
torch.manual_seed(0)
model = smp.DistributedModel(Net())
if not args.no_checkpointing:
    smp.set_activation_checkpointing(model.get_module().decoder, strategy=args.strategy)
optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))


@smp.step
def train_step(model, data, target):
    loss = nn.functional.mse_loss(model(data), target)
    model.backward(loss)
    return loss


data, target = torch.randn(8, 32), torch.randn(8, 1)
optimizer.zero_grad()
loss = train_step(model, data, target).reduce_mean()
print(f"loss {loss.item():.6f}")

digest = hashlib.sha256()
for _, param in model.named_parameters():
    if param.grad is not None:
        digest.update(param.grad.detach().to(torch.float32).contiguous().numpy().tobytes())
optimizer.step()
print(f"GRADS {digest.hexdigest()}")
