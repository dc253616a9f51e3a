"""Benchmark: per-rank peak RSS (VmHWM) of an SMP v1 pipeline against the same script in one process.

An SMP v1 script (8 pre-norm MLP blocks of width 512, 32 MiB of parameters per 4 blocks, AdamW,
2 microbatches, the block stack checkpointed with strategy "contiguous") trains 3 steps. Under
torchrun with 2 ranks each rank owns one partition: it computes, steps and keeps optimizer state
for its half of the parameters only (the others are released after partitioning) and saves only
its own activations. Each rank prints its own parameter bytes and its VmHWM.

    torchrun --nproc-per-node 2 -m acshim run benchmarks/bench_smp_pipeline_memory.py   # 2 partitions
    python -m acshim run benchmarks/bench_smp_pipeline_memory.py                        # one process
"""
import smdistributed.modelparallel.torch as smp
import torch
import torch.nn as nn


def vmhwm_mib():
    with open("/proc/self/status") as status:
        lines = status.read().splitlines()
    for line in lines:
        if line.startswith("VmHWM"):
            return int(line.split()[1]) / 1024

class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
    def forward(self, x):
        return x + self.mlp(self.norm(x))

smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True})
torch.manual_seed(0)
width = 512
start = vmhwm_mib()
net = nn.Sequential(*[Block(width) for _ in range(8)])
model = smp.DistributedModel(net)
smp.set_activation_checkpointing(net, strategy="contiguous")
optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))

@smp.step
def train_step(model, x):
    loss = model(x).pow(2).mean()
    model.backward(loss)
    return loss

for _ in range(3):
    optimizer.zero_grad()
    train_step(model, torch.randn(16, 128, width))
    optimizer.step()
local = sum(p.numel() for _, p in model.local_named_parameters())
print(f"rank {smp.rank()} pp {smp.pp_rank()}/{smp.pp_size()}: local parameters {local * 4 / 2**20:.1f} MiB, "
      f"VmHWM {vmhwm_mib():.0f} MiB (at start {start:.0f} MiB)", flush=True)
