"""``torchrun ... -m acshim run --budget B smp_v1_pipeline_budget.py [--pipeline simple|interleaved]``:
an SMP v1 script (``pipeline_parallel_degree`` 2, automatic partitioning, ``microbatches`` 2) on 2
gloo ranks, every block checkpointed with ``smp.set_activation_checkpointing``, trained 2 steps
twice: first unplanned (acshim's plan set aside: every block recomputed, as the script asks), then
under the plan (the data made before the first step). Every rank prints ``RESULT {json}`` as
pipelining_budget.py does: its stage, whether its own parameters and the losses are bitwise those
of the unplanned run (dropout on), ``VmHWM`` above each run's first step's start, the plan, and
the most microbatches the stage runner held at once.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json

import smdistributed.modelparallel.torch as smp
import torch
import torch.distributed as dist
from torch import nn

import acshim.region

WIDTH, ROWS, BLOCKS, MICRO, STEPS = 256, 4096, 16, 2, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(self.linear(x)).tanh()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.first = nn.Sequential(*(Block() for _ in range(BLOCKS // 2)))
        self.second = nn.Sequential(*(Block() for _ in range(BLOCKS // 2)))
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.second(self.first(self.embed(x))))


@smp.step
def train_step(model: smp.DistributedModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = nn.functional.mse_loss(model(x), y)
    model.backward(loss)
    return loss


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field + ":"))


def train(pipeline: str) -> dict:
    smp.init({"pipeline_parallel_degree": 2, "microbatches": MICRO, "pipeline": pipeline, "auto_partition": True})
    torch.manual_seed(0)
    net = Net()
    model = smp.DistributedModel(net)
    for block in (*net.first, *net.second):
        smp.set_activation_checkpointing(block)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    generator = torch.Generator().manual_seed(7)
    data = [(torch.randn(MICRO * ROWS, WIDTH, generator=generator), torch.randn(MICRO * ROWS, WIDTH, generator=generator))
            for _ in range(STEPS)]
    torch.manual_seed(100)
    dist.barrier()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    start = _status("VmRSS")
    losses = []
    for x, y in data:
        optimizer.zero_grad(set_to_none=True)
        losses.append([loss.item() for loss in train_step(model, x, y).outputs])
        optimizer.step()
    peak = _status("VmHWM") - start
    local = model.local_state_dict()
    weights = b"".join(local[name].detach().numpy().tobytes() for name in sorted(local))
    result = {"losses": losses, "weights": hashlib.sha256(weights).hexdigest(), "peak": peak,
              "parameters": sorted(local), "most_alive": model.runner.most_alive}
    smp.reset()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pipeline", default="interleaved", choices=("simple", "interleaved"))
    parser.add_argument("--planned-only", action="store_true", help="skip the unplanned run (a budget refused)")
    args = parser.parse_args()
    sessions = list(acshim.region.ROUTERS)
    for session in sessions:  # the run the plan is compared with goes unplanned
        acshim.region.ROUTERS.remove(session)
    unplanned = train(args.pipeline) if not args.planned_only else {"peak": 0, "losses": None, "weights": None}
    acshim.region.ROUTERS.extend(sessions)
    planned = train(args.pipeline)
    rank = smp.rank()
    result = {"rank": rank, "stage": smp.pp_rank(), "peak": planned["peak"], "unplanned": unplanned["peak"],
              "most_alive": planned["most_alive"], "parameters": planned["parameters"],
              "equal": (planned["losses"], planned["weights"]) == (unplanned["losses"], unplanned["weights"])}
    if sessions and sessions[0].plan is not None:
        session = sessions[0]
        result.update(choices=session.plan.choices, outside=session.plan.outside, budget=session.stage_budget,
                      in_flight=session.pipeline.in_flight if session.pipeline else None,
                      predicted=session.stage_predicted)
    print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
