"""``torchrun ... -m acshim run --budget B deepspeed_pipeline_budget.py``: real DeepSpeed pipeline
parallelism (a ``PipelineModule`` of 2 stages of ``Block`` layers, ``engine.train_batch()`` with 4
micro-batches, DeepSpeed's CPU accelerator, gloo) trained twice for 2 steps (the planning step,
then one under the plan): first without checkpointing and unplanned
(``activation_checkpoint_interval=0``, acshim's plan set aside), then with every layer checkpointed
(interval 1) under the plan. Every rank prints ``RESULT {json}``: its stage, whether losses and its
stage's weights are bitwise equal between the two runs (dropout on), each run's peak as the kernel
saw it (``VmHWM`` above the process's memory when its first ``train_batch`` started, heap trimmed
and high-water mark reset there: shared/MEASURING.md), and the plan: its choices, the rank's budget
in bytes and the microbatches alive at once on the stage.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.pipe import LayerSpec, PipelineModule
from torch import nn

import acshim.region

WIDTH, ROWS, BLOCKS, MICRO, STEPS = 512, 2048, 16, 4, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.dropout = nn.Dropout(float(os.environ.get("BUDGET_DROPOUT", "0.1")))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(self.linear(x)).tanh()


def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(outputs, targets)


def batches(seed: int):
    generator = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randn(ROWS, WIDTH, generator=generator), torch.randn(ROWS, WIDTH, generator=generator)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field + ":"))


def _start() -> int:
    """Trim the heap, reset the high-water mark, and return the resident memory now."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    return _status_kib("VmRSS")


def train(interval: int) -> dict:
    torch.manual_seed(0)
    model = PipelineModule(layers=[LayerSpec(Block) for _ in range(BLOCKS)], num_stages=2, loss_fn=loss_fn,
                           partition_method="uniform", activation_checkpoint_interval=interval)
    config = {"train_batch_size": MICRO * ROWS, "train_micro_batch_size_per_gpu": ROWS,
              "gradient_accumulation_steps": MICRO, "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
              "steps_per_print": 1000, "pipeline": {"activation_checkpoint_interval": interval}}
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=list(model.parameters()))
    torch.manual_seed(100)
    data = batches(7)
    dist.barrier()
    start = _start()
    losses, peaks = [], []
    for _ in range(STEPS):
        losses.append(engine.train_batch(data_iter=data).item())
        peaks.append(_status_kib("VmHWM") - start)
    peak = peaks[-1]
    weights = b"".join(p.detach().numpy().tobytes() for _, p in sorted(engine.module.named_parameters()))
    result = {"losses": losses, "weights": hashlib.sha256(weights).hexdigest(), "peak": peak, "peaks": peaks,
              "stage": engine.stage_id}
    engine.destroy()
    return result


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    sessions = list(acshim.region.ROUTERS)
    for session in sessions:  # the run without checkpointing goes unplanned
        acshim.region.ROUTERS.remove(session)
    none = train(0)
    acshim.region.ROUTERS.extend(sessions)
    planned = train(1)
    result = {"rank": dist.get_rank(), "stage": planned["stage"], "peak": planned["peak"], "none": none["peak"], "peaks": planned["peaks"], "losses": [none["losses"], planned["losses"]],
              "equal": (planned["losses"], planned["weights"]) == (none["losses"], none["weights"])}
    if sessions and sessions[0].plan is not None:
        session = sessions[0]
        result.update(choices=session.plan.choices, outside=session.plan.outside, budget=session.stage_budget,
                      in_flight=session.pipeline.in_flight if session.pipeline else None)
    print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    from acshim.exit_settle import settle_collective_threads  # as deepspeed_pipeline.py: gloo threads at exit

    settle_collective_threads()


if __name__ == "__main__":
    main()
