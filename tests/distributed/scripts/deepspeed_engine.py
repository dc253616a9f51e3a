"""A DeepSpeed training script (deepspeed.initialize, the JSON activation_checkpointing block,
deepspeed.checkpointing.checkpoint in the model) on DeepSpeed's CPU accelerator with gloo: two
steps for each ZeRO stage 0-3, in one process. Run as it is (real DeepSpeed) or under
``acshim run`` by tests/distributed; every rank prints one ``RESULT {json}`` line with, per stage,
the losses and a digest of the full (gathered) parameters after the two optimizer steps.

usage: deepspeed_engine.py --checkpoint deepspeed|none --dropout P [--stages 0,1,2,3]
"""

from __future__ import annotations

import argparse
import hashlib
import json

import deepspeed
import torch
import torch.distributed as dist
from torch import nn


class Net(nn.Module):
    def __init__(self, dropout: float, checkpoint: bool) -> None:
        super().__init__()
        # A stem outside the checkpoints, so every checkpoint input requires grad: upstream's
        # reentrant checkpoint gives a block whose input does not no parameter gradient at all.
        self.stem = nn.Linear(16, 16)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 16), nn.Dropout(dropout), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(16, 1)
        self.checkpoint = checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = deepspeed.checkpointing.checkpoint(block, x) if self.checkpoint else block(x)
        return self.head(x).pow(2).mean()


def config(stage: int) -> dict:
    return {
        "train_batch_size": 16, "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage},
        "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False,
                                     "contiguous_memory_optimization": False},
    }


def digest(model: nn.Module) -> str:
    """The full parameters (ZeRO-3: gathered; its shards carry uninitialised padding)."""
    parameters = list(model.parameters())
    with deepspeed.zero.GatheredParameters(parameters):
        data = b"".join(p.detach().float().numpy().tobytes() for p in parameters)
    return hashlib.sha256(data).hexdigest()


def run_stage(stage: int, checkpoint: bool, dropout: float) -> dict:
    torch.manual_seed(0)
    model = Net(dropout, checkpoint)
    engine, _, _, _ = deepspeed.initialize(model=model, config=config(stage),
                                           model_parameters=model.parameters())
    deepspeed.checkpointing.configure(None, deepspeed_config=config(stage))
    torch.manual_seed(100 + dist.get_rank())
    losses = []
    for _ in range(2):
        loss = engine(torch.randn(8, 16))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    result = {"losses": losses, "parameters": digest(engine.module)}
    engine.destroy()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", choices=("deepspeed", "none"), required=True)
    parser.add_argument("--dropout", type=float, required=True)
    parser.add_argument("--stages", default="0,1,2,3")
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    results = {stage: run_stage(int(stage), args.checkpoint == "deepspeed", args.dropout)
               for stage in args.stages.split(",")}
    print("RESULT " + json.dumps({"rank": dist.get_rank(), "results": results}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    # the run without acshim waits for Gloo's worker threads at exit as acshim does (acshim/exit_settle.py:
    # torch 2.13 aborts a rank that finalizes while one drops its last work); imported after the results
    from acshim.exit_settle import settle_collective_threads

    settle_collective_threads()


if __name__ == "__main__":
    main()
