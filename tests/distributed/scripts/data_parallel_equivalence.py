"""A data-parallel training script written only against upstream APIs (torch, DeepSpeed,
FairScale): for each checkpointing dialect and each DDP / FSDP1 / FSDP2 setting, two steps with
checkpointing against two steps without, on the same ranks. Run under ``acshim run`` by
tests/distributed; every rank prints one ``RESULT {json}`` line.

usage: data_parallel_equivalence.py --engine ddp|fsdp1|fsdp2 [--dialects a,b,...]
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import torch
import torch.distributed as dist
from torch import nn

DIALECTS = ("torch_reentrant", "torch_non_reentrant", "deepspeed", "fairscale")


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.linear(x)).tanh() + x


class Net(nn.Module):
    """Four blocks and a head; ``spare`` (with ``unused=True``) is never used: what DDP's
    find_unused_parameters and static_graph are for."""

    def __init__(self, width: int = 16, deepspeed_checkpoint: bool = False, unused: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(4))
        self.head = nn.Linear(width, 1)
        self.spare = nn.Linear(width, width) if unused else None
        self.deepspeed_checkpoint = deepspeed_checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.deepspeed_checkpoint:
                import deepspeed

                x = deepspeed.checkpointing.checkpoint(block, x)
            else:
                x = block(x)
        return self.head(x)


def build(dialect: str | None, setting: str) -> nn.Module:
    torch.manual_seed(0)
    model = Net(deepspeed_checkpoint=dialect == "deepspeed", unused=setting in ("find_unused", "static_graph"))
    if dialect in ("torch_reentrant", "torch_non_reentrant"):
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl,
            apply_activation_checkpointing,
            checkpoint_wrapper,
        )

        impl = CheckpointImpl.REENTRANT if dialect == "torch_reentrant" else CheckpointImpl.NO_REENTRANT
        apply_activation_checkpointing(
            model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=impl),
            check_fn=lambda module: isinstance(module, Block))
    elif dialect == "fairscale":
        from fairscale.nn.checkpoint import checkpoint_wrapper

        for index, block in enumerate(model.blocks):
            model.blocks[index] = checkpoint_wrapper(block)
    return model


def wrap(model: nn.Module, engine: str, setting: str) -> nn.Module:
    if engine == "ddp":
        options = {"plain": {}, "find_unused": {"find_unused_parameters": True},
                   "static_graph": {"static_graph": True}}[setting]
        return nn.parallel.DistributedDataParallel(model, **options)
    if engine == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}),
                                        device_id=torch.device("cpu"), use_orig_params=setting == "orig_params")
    from torch.distributed.fsdp import fully_shard

    for module in model.modules():
        if isinstance(module, Block):
            fully_shard(module)
    fully_shard(model)
    return model


def gradients(model: nn.Module) -> list[torch.Tensor]:
    if getattr(model, "_use_orig_params", False):  # FSDP1 with original parameters: unsharded gradients
        with model.summon_full_params(model, with_grads=True):
            return [p.grad.clone() if p.grad is not None else None for p in model.parameters()]
    grads = []
    for parameter in model.parameters():
        grad = parameter.grad
        if grad is not None and hasattr(grad, "full_tensor"):
            grad = grad.full_tensor()
        grads.append(grad)
    return grads


def train(dialect: str | None, engine: str, setting: str) -> tuple[list[torch.Tensor], list[float]]:
    model = wrap(build(dialect, setting), engine, setting)
    torch.manual_seed(1000 + dist.get_rank())
    losses = []
    for _ in range(2):  # the second step accumulates: gradients of both steps
        loss = model(torch.randn(8, 16)).pow(2).mean()
        loss.backward()
        losses.append(loss.item())
    return gradients(model), losses


def compare(dialect: str, engine: str, setting: str) -> str:
    expected_grads, expected_losses = train(None, engine, setting)
    try:
        grads, losses = train(dialect, engine, setting)
    except Exception as error:  # reported, not raised: one rank's result must not hang the other
        return f"error: {type(error).__name__}: {str(error)[:300]}"
    if losses != expected_losses:
        return f"losses differ: {losses} vs {expected_losses}"
    for index, (got, want) in enumerate(zip(grads, expected_grads)):
        if (got is None) != (want is None) or (got is not None and not torch.equal(got, want)):
            return f"gradient {index} differs"
    return "equal"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", choices=("ddp", "fsdp1", "fsdp2"), required=True)
    parser.add_argument("--dialects", default=",".join(DIALECTS))
    parser.add_argument("--settings", default="")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    default_settings = {"ddp": ["plain", "find_unused", "static_graph"], "fsdp1": ["orig_params", "flat_params"],
                        "fsdp2": ["fully_shard"]}
    settings = args.settings.split(",") if args.settings else default_settings[args.engine]
    results = {f"{dialect}/{setting}": compare(dialect, args.engine, setting)
               for dialect in args.dialects.split(",") for setting in settings}
    print("RESULT " + json.dumps({"rank": dist.get_rank(), "world_size": dist.get_world_size(),
                                  "local_rank": int(os.environ["LOCAL_RANK"]), "results": results}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
