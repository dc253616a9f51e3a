"""SageMaker model parallelism v1: a pipeline of two partitions, checkpointed, trained with microbatches.

An unchanged SMP v1 script: ``pipeline_parallel_degree`` 2 with automatic partitioning, 2
microbatches, ``smp.set_activation_checkpointing`` on the transformer-like block stack (strategy
``"contiguous"``: one region per partition's run of blocks), ``@smp.step`` with
``model.backward(loss)``, ``smp.DistributedOptimizer``, and the state dict gathered across
partitions. Run it across two ranks, one partition each:

    torchrun --nproc-per-node 2 -m acshim run examples/smp_v1_pipeline.py [--no-checkpointing]

or in one process (the two partitions then run as one, with a warning):

    python -m acshim run examples/smp_v1_pipeline.py [--no-checkpointing]

Global rank 0 prints the digest of every parameter's gradient (each stage contributes the ones it
owns) and of the trained weights: the same digest on two ranks and on one process, with
checkpointing and without.
"""

import argparse
import hashlib

import smdistributed.modelparallel.torch as smp
import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--no-checkpointing", action="store_true")
args = parser.parse_args()


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * width, width))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Net(nn.Module):
    def __init__(self, vocab=64, width=32, depth=6):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(*[Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        return self.head(self.blocks(self.embed(tokens)))


smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True, "auto_partition": True,
          "pipeline": "interleaved"})
torch.manual_seed(0)
model = smp.DistributedModel(Net())
if not args.no_checkpointing:
    smp.set_activation_checkpointing(model.get_module().blocks, strategy="contiguous")
optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))


@smp.step
def train_step(model, tokens, targets):
    logits = model(tokens)
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    model.backward(loss)
    return loss


generator = torch.Generator().manual_seed(smp.dp_rank())
for step in range(3):
    tokens = torch.randint(0, 64, (8, 16), generator=generator)
    optimizer.zero_grad()
    loss = train_step(model, tokens[:, :-1], tokens[:, 1:]).reduce_mean()
    if smp.rank() == 0:
        print(f"step {step} loss {loss.item():.6f} (pp_rank {smp.pp_rank()} of {smp.pp_size()})")
    if step < 2:
        optimizer.step()

# every parameter's gradient, each from the partition that owns it (smp.allgather over the pipeline group)
local = {name: p.grad for name, p in model.local_named_parameters() if p.grad is not None}
gradients = {}
for part in smp.allgather(local, smp.PP_GROUP):
    gradients.update(part)
optimizer.step()
weights = model.state_dict()  # gathered across partitions: call it on every rank
if smp.rank() == 0:
    digest = hashlib.sha256()
    for name in sorted(gradients):
        digest.update(gradients[name].to(torch.float32).contiguous().numpy().tobytes())
    for name in sorted(weights):
        digest.update(weights[name].to(torch.float32).contiguous().numpy().tobytes())
    print(f"GRADS {digest.hexdigest()}")
