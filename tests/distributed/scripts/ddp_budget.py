"""A DDP training script with torch's checkpoint_wrapper, run by tests/distributed as
``torchrun ... -m acshim run --budget B ddp_budget.py --setting S [--fsdp2]``: two steps (dropout on)
against two steps of the same DDP model without checkpointing; every rank prints ``RESULT {json}``
with its plan, its measured peak and whether its gradients are bitwise equal."""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)

import acshim

SLOW = os.environ.get("SLOW_RANK") == os.environ.get("RANK")
WIDTH, ROWS = (int(n) for n in os.environ.get("DDP_BUDGET_SIZE", "32x64").split("x"))


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if SLOW:  # this rank is slower: its timings differ from the other's, the plan must not
            time.sleep(0.002)
        return x + self.down(self.dropout(self.up(x).relu()))


class Net(nn.Module):
    def __init__(self, width: int = 32, unused: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(4))
        self.head = nn.Linear(width, 1)
        self.spare = nn.Linear(width, width) if unused else None  # never used (find_unused / static_graph)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(checkpointed: bool, setting: str, impl: CheckpointImpl) -> nn.Module:
    torch.manual_seed(0)
    model = Net(WIDTH, unused=setting != "plain")
    if checkpointed:
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper,
                                                                                      checkpoint_impl=impl),
                                       check_fn=lambda module: isinstance(module, Block))
    if setting == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
        return model
    options = {"plain": {}, "find_unused": {"find_unused_parameters": True}, "static_graph": {"static_graph": True}}
    return nn.parallel.DistributedDataParallel(model, **options[setting])


def train(model: nn.Module, batches: list[torch.Tensor]) -> list[torch.Tensor]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1000 + dist.get_rank())
    for batch in batches:
        optimizer.zero_grad()
        model(batch).pow(2).mean().backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--setting", default="plain", choices=("plain", "find_unused", "static_graph", "fsdp2"))
    parser.add_argument("--reentrant", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    impl = CheckpointImpl.REENTRANT if args.reentrant else CheckpointImpl.NO_REENTRANT
    generator = torch.Generator().manual_seed(dist.get_rank())
    batches = [torch.randn(ROWS, WIDTH, generator=generator) for _ in range(3)]
    reference = train(build(False, args.setting, impl), batches)
    model = build(True, args.setting, impl)
    weights = train(model, batches)
    equal = all(torch.equal(a, b) for a, b in zip(weights, reference, strict=True))
    result = {"rank": dist.get_rank(), "equal": equal}
    if acshim.region.ROUTERS:
        from acshim.planner import measure_step

        session = acshim.region.ROUTERS[0]
        model.zero_grad(set_to_none=True)  # a step as the script runs it: gradients start as None
        held, peak = measure_step(model.module, batches[0], lambda out: out.pow(2).mean())
        result.update(choices=session.plan.choices, budget=session.plan.budget, peak=peak)
    print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
