"""A rank started by a launcher (torchrun, python -m torch.distributed.run, accelerate launch,
deepspeed), written only against upstream APIs: one DDP step of a small model whose blocks are
wrapped with PyTorch's ``checkpoint_wrapper``, and the same step without checkpointing, on a gloo
group. Prints ``RESULT {json}``: rank, world size, whether acshim's patches are in effect, whether
the gradients after allreduce are bitwise equal to those without checkpointing.

usage: launched_rank.py [--fail-rank N] [--accelerator]
  --fail-rank N   rank N raises after its step
  --accelerator   Accelerate's ``Accelerator(cpu=True)`` starts the group and wraps the models
"""

from __future__ import annotations

import argparse
import copy
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.nn.parallel import DistributedDataParallel


def step(model: nn.Module, rank: int, accelerator=None) -> tuple[list[torch.Tensor], str]:
    ddp = accelerator.prepare(model) if accelerator is not None else DistributedDataParallel(model)
    torch.manual_seed(100 + rank)  # each rank its own data and dropout masks
    loss = ddp(torch.randn(4, 8)).square().sum()
    accelerator.backward(loss) if accelerator is not None else loss.backward()
    return [p.grad for p in model.parameters()], type(ddp).__name__


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-rank", type=int, default=None)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None)  # the deepspeed launcher's
    parser.add_argument("--accelerator", action="store_true")
    args = parser.parse_args()
    accelerator = None
    if args.accelerator:
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)  # MULTI_CPU on gloo under a launcher's WORLD_SIZE
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    plain = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1), nn.Tanh()) for _ in range(3)))
    checkpointed = nn.Sequential(*(checkpoint_wrapper(copy.deepcopy(block)) for block in plain))
    (expected, _), (got, wrapper) = step(plain, rank, accelerator), step(checkpointed, rank, accelerator)
    from acshim.patching.inplace import is_acshim_wrapper

    print("RESULT " + json.dumps({
        "rank": rank, "world_size": world, "local_rank": int(os.environ.get("LOCAL_RANK", -1)),
        "patched": is_acshim_wrapper(checkpoint_wrapper), "wrapper": wrapper,
        "equal": len(got) == len(expected) and all(torch.equal(g, e) for g, e in zip(got, expected)),
    }), flush=True)
    if args.fail_rank == rank:
        raise RuntimeError(f"rank {rank} failed on purpose")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
