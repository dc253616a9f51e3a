"""``torchrun ... -m acshim run --budget B pipelining_budget.py [--schedule 1F1B|GPipe] [--planned-only]``:
``torch.distributed.pipelining`` on 2 gloo ranks, each a ``PipelineStage`` of 8 ``Block`` layers whose
forward checkpoints each layer (``torch.utils.checkpoint``), trained 2 steps of 4 microbatches (the
planning step, then one under the plan) twice: first unplanned (acshim's plan set aside), then under
the plan (the batches of all steps made before the first step starts, as a data set in memory).
``--planned-only`` skips the unplanned run, for a budget expected to be refused (its ``equal`` is
then false). Every rank prints ``RESULT {json}`` as deepspeed_pipeline_budget.py does (stage,
bitwise equality of losses and weights, ``VmHWM`` above each run's first step's start, the plan).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.utils.checkpoint import checkpoint

import acshim.region

WIDTH, ROWS, BLOCKS, MICRO, STEPS = 512, 2048, 8, 4, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(self.linear(x)).tanh()


class Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field + ":"))


def train(rank: int, schedule_name: str) -> dict:
    torch.manual_seed(rank)
    stage_module = Stage()
    stage = PipelineStage(stage_module, rank, 2, torch.device("cpu"))
    kind = Schedule1F1B if schedule_name == "1F1B" else ScheduleGPipe
    schedule = kind(stage, n_microbatches=MICRO, loss_fn=nn.functional.mse_loss)
    optimizer = torch.optim.SGD(stage_module.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(7)
    # the data set is made before the first step (it is the script's, not the step's memory)
    data = [(torch.randn(MICRO * ROWS, WIDTH, generator=generator), torch.randn(MICRO * ROWS, WIDTH, generator=generator))
            for _ in range(STEPS)]
    torch.manual_seed(100 + rank)
    dist.barrier()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    start = _status("VmRSS")
    losses = []
    for x, target in data:
        optimizer.zero_grad(set_to_none=True)
        step_losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=target, losses=step_losses)
        optimizer.step()
        losses.append([loss.item() for loss in step_losses])
    weights = b"".join(p.detach().numpy().tobytes() for _, p in sorted(stage_module.named_parameters()))
    return {"losses": losses, "weights": hashlib.sha256(weights).hexdigest(), "peak": _status("VmHWM") - start}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schedule", default="1F1B", choices=("1F1B", "GPipe"))
    parser.add_argument("--planned-only", action="store_true", help="skip the unplanned run (a budget refused)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    sessions = list(acshim.region.ROUTERS)
    for session in sessions:  # the run the plan is compared with goes unplanned
        acshim.region.ROUTERS.remove(session)
    # every region recomputed, as the script asks
    unplanned = train(rank, args.schedule) if not args.planned_only else {"peak": 0, "losses": None, "weights": None}
    acshim.region.ROUTERS.extend(sessions)
    planned = train(rank, args.schedule)
    result = {"rank": rank, "stage": rank, "peak": planned["peak"], "unplanned": unplanned["peak"],
              "equal": (planned["losses"], planned["weights"]) == (unplanned["losses"], unplanned["weights"])}
    if sessions and sessions[0].plan is not None:
        session = sessions[0]
        result.update(choices=session.plan.choices, outside=session.plan.outside, budget=session.stage_budget,
                      in_flight=session.pipeline.in_flight if session.pipeline else None)
    print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
