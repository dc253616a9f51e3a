"""SageMaker model parallelism v1: checkpoint one layer inside forward (dev guide, example 1).

Run with ``acshim run examples/smp_v1_conv_checkpoint.py [--no-checkpointing]``.
"""

import argparse
import hashlib

import smdistributed.modelparallel.torch as smp
import torch
import torch.nn as nn
import torch.nn.functional as F
from smdistributed.modelparallel.torch.patches.checkpoint import checkpoint

parser = argparse.ArgumentParser()
parser.add_argument("--no-checkpointing", action="store_true")
args = parser.parse_args()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.dropout = nn.Dropout(0.25)
        self.fc1 = nn.Linear(8 * 5 * 5, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = torch.flatten(self.dropout(x), 1)
        x = self.fc1(x) if args.no_checkpointing else checkpoint(self.fc1, x)
        x = self.dropout(F.relu(x))
        return F.log_softmax(self.fc2(x), dim=1)


smp.init({"partitions": 1, "microbatches": 2})
torch.manual_seed(0)
model = smp.DistributedModel(Net())
optimizer = smp.DistributedOptimizer(torch.optim.Adadelta(model.parameters(), lr=1.0))


@smp.step
def train_step(model, data, target):
    output = model(data)
    loss = F.nll_loss(output, target)
    model.backward(loss)
    return loss


data, target = torch.randn(8, 1, 12, 12), torch.randint(0, 10, (8,))
optimizer.zero_grad()
loss = train_step(model, data, target).reduce_mean()
if smp.rank() == 0:
    print(f"loss {loss.item():.6f}")

digest = hashlib.sha256()
for _, param in model.named_parameters():
    if param.grad is not None:
        digest.update(param.grad.detach().to(torch.float32).contiguous().numpy().tobytes())
optimizer.step()
print(f"GRADS {digest.hexdigest()}")
