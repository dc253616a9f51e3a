"""PyTorch selective checkpointing with torch's own CPU-offload policy: matmul outputs are marked
``CheckpointPolicy.MUST_CPU_OFFLOAD``, everything else recomputed.

Written purely against torch's API. Plain torch honours the offload decision only under
``torch.compile`` and recomputes those ops in eager mode; under
`ACSHIM_OFFLOAD_STORAGE=disk acshim run examples/torch_cpu_offload_policy.py` the matmul outputs go to
disk and come back for the recompute (`--report` shows the bytes moved). `--no-checkpointing` runs the
same step without checkpointing. Last line: GRADS <sha256 of all gradients>.
"""

import functools
import hashlib
import sys

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


def policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_CPU_OFFLOAD if op in MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


class Model(nn.Module):
    def __init__(self, checkpointing: bool) -> None:
        super().__init__()
        self.checkpointing = checkpointing
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Dropout(0.1), nn.Linear(256, 64))
                                    for _ in range(4))
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        for block in self.blocks:
            if self.checkpointing:
                x = x + checkpoint(block, x, use_reentrant=False,
                                   context_fn=functools.partial(create_selective_checkpoint_contexts, policy))
            else:
                x = x + block(x)
        return self.head(x)


def main() -> None:
    torch.manual_seed(0)
    model = Model("--no-checkpointing" not in sys.argv)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)
    loss = model(x).square().mean()
    loss.backward()
    digest = hashlib.sha256()
    for _, parameter in model.named_parameters():
        digest.update(parameter.grad.detach().contiguous().numpy().tobytes())
    print(f"loss {loss.item():.6f}")
    print(f"GRADS {digest.hexdigest()}")


if __name__ == "__main__":
    main()
