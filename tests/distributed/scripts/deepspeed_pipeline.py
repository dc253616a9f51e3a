"""A DeepSpeed pipeline-parallel training script: ``PipelineModule`` of 2 stages (``LayerSpec``
layers, a ``TiedLayerSpec`` input projection tied to the output projection), ``deepspeed.initialize`` and
``engine.train_batch()`` with 2 micro-batches, on DeepSpeed's CPU accelerator with gloo. Run as it
is (real DeepSpeed) or under ``acshim run`` by tests/distributed/test_deepspeed_pipeline.py.

For each ``activation_checkpoint_interval`` asked (``checkpointable_layers`` set or not) it trains
two steps and every rank prints one ``RESULT {json}`` line with, per case, the losses and a digest
of the parameters its stage holds after the two optimizer steps.

usage: deepspeed_pipeline.py --dropout P [--cases 0,1,2,1-Block]   (interval[-checkpointable class])
"""

from __future__ import annotations

import argparse
import hashlib
import json

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn

FEATURES, WIDTH = 12, 16


class Block(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(self.linear(x)).tanh()


class Mixer(nn.Module):
    """A layer with parameters that is not a Block (``checkpointable_layers=["Block"]`` leaves it out)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).sigmoid() * x


class Projection(nn.Module):
    """Features in; its weight also projects back out at the last stage (tied)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(WIDTH, FEATURES) * 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


def project_out(projection: Projection, hidden: torch.Tensor) -> torch.Tensor:
    """The output projection, tied to the input one (TiedLayerSpec's forward_fn)."""
    return hidden @ projection.weight


def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(outputs, targets)


def layers(dropout: float) -> list:
    return [
        TiedLayerSpec("proj", Projection),
        LayerSpec(Block, dropout), LayerSpec(Mixer), LayerSpec(Block, dropout),
        LayerSpec(Block, dropout), LayerSpec(Mixer), LayerSpec(Block, dropout),
        TiedLayerSpec("proj", Projection, forward_fn=project_out),
    ]


def config(interval: int) -> dict:
    # the engine's own "pipeline" key: with it, the first stage's float inputs require grad, which
    # upstream's reentrant checkpoint needs to give the first layer's parameters gradients
    return {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "steps_per_print": 1000,
            "pipeline": {"activation_checkpoint_interval": interval}}


def batches(seed: int):
    generator = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randn(2, FEATURES, generator=generator), torch.randn(2, FEATURES, generator=generator)


def digest(module: nn.Module) -> str:
    data = b"".join(p.detach().float().numpy().tobytes() for _, p in sorted(module.named_parameters()))
    return hashlib.sha256(data).hexdigest()


def run_case(case: str, dropout: float) -> dict:
    interval, _, checkpointable = case.partition("-")
    torch.manual_seed(0)
    model = PipelineModule(layers=layers(dropout), num_stages=2, loss_fn=loss_fn, partition_method="uniform",
                           activation_checkpoint_interval=int(interval),
                           checkpointable_layers=[checkpointable] if checkpointable else None)
    engine, _, _, _ = deepspeed.initialize(model=model, config=config(int(interval)),
                                           model_parameters=[p for p in model.parameters() if p.requires_grad])
    torch.manual_seed(100)
    data = batches(7)
    losses = [engine.train_batch(data_iter=data).item() for _ in range(2)]
    result = {"losses": losses, "parameters": digest(engine.module), "stage": engine.stage_id}
    engine.destroy()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dropout", type=float, required=True)
    parser.add_argument("--cases", default="0,1,2,1-Block")
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    results = {case: run_case(case, args.dropout) for case in args.cases.split(",")}
    print("RESULT " + json.dumps({"rank": dist.get_rank(), "results": results}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    from acshim.exit_settle import settle_collective_threads  # as deepspeed_engine.py: gloo threads at exit

    settle_collective_threads()


if __name__ == "__main__":
    main()
