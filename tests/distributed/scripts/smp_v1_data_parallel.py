"""A SageMaker model parallelism v1 training script (``ddp: True``, 2 microbatches), written only
against the SMP v1 API and torch. It trains two steps with ``smp.set_activation_checkpointing`` on
each block and two without, on the same ranks, and prints one ``RESULT {json}`` line per rank:
rank helpers, whether losses and gradients match bitwise, and whether the gradients are the
average of every rank's local ones. Run under ``acshim run`` by tests/distributed.
"""

from __future__ import annotations

import json

import smdistributed.modelparallel.torch as smp
import torch
import torch.distributed as dist
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.linear(x)).tanh() + x


class Net(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(width) for _ in range(4)))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


@smp.step
def train_step(model: smp.DistributedModel, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).pow(2).mean()
    model.backward(loss)
    return loss


def local_gradients() -> list[torch.Tensor]:
    """Step 0 of this rank alone, without SMP: the mean of the two microbatches' gradients."""
    torch.manual_seed(0)
    net = Net()
    torch.manual_seed(smp.dp_rank())
    x = torch.randn(8, 16)
    loss = sum(net(half).pow(2).mean() for half in x.chunk(2)) / 2
    return list(torch.autograd.grad(loss, list(net.parameters())))


def run(checkpointed: bool) -> tuple[list[float], list[list[torch.Tensor]]]:
    """Losses of two steps and each step's gradients."""
    smp.reset()
    torch.manual_seed(0)  # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
    net = Net()
    model = smp.DistributedModel(net)
    if checkpointed:  # after wrapping, as SMP requires
        for block in net.blocks:
            smp.set_activation_checkpointing(block)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    losses, gradients = [], []
    for step in range(2):
        torch.manual_seed(100 * step + smp.dp_rank())  # each data-parallel rank has its own shard and masks
        x = torch.randn(8, 16)
        optimizer.zero_grad()
        losses.append(train_step(model, x).reduce_mean().item())
        gradients.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
    return losses, gradients


def identical_across_ranks(gradients: list[torch.Tensor]) -> bool:
    """Every rank holds the same (all-reduced) gradients."""
    gathered = smp.allgather(gradients, smp.DP_GROUP)
    return all(torch.equal(g, gathered[0][i]) for i, g in enumerate(gradients)) and len(gathered) == smp.dp_size()


def main() -> None:
    smp.init({"ddp": True, "microbatches": 2, "partitions": 1})
    plain_losses, plain_grads = run(checkpointed=False)
    checkpointed_losses, checkpointed_grads = run(checkpointed=True)
    equal = plain_losses == checkpointed_losses and all(
        torch.equal(a, b) for step_a, step_b in zip(plain_grads, checkpointed_grads) for a, b in zip(step_a, step_b))
    others = smp.allgather(plain_losses, smp.DP_GROUP)
    if smp.rank() == 0:
        smp.broadcast({"from": 0}, smp.DP_GROUP)
        received = smp.recv_from(1, smp.RankType.DP_RANK)
    else:
        received = smp.recv_from(0, smp.RankType.DP_RANK)
        smp.send({"from": smp.rank()}, 0, smp.RankType.DP_RANK)
    smp.dp_barrier()
    every_rank = smp.allgather(local_gradients(), smp.DP_GROUP)
    average = [torch.stack(per_parameter).mean(0) for per_parameter in zip(*every_rank)]
    averaged = all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(average, plain_grads[0]))
    print("RESULT " + json.dumps({
        "rank": smp.rank(), "size": smp.size(), "dp_rank": smp.dp_rank(), "dp_size": smp.dp_size(),
        "mp_size": smp.mp_size(), "local_rank": smp.local_rank(), "dp_group": smp.get_dp_group(),
        "mp_group": smp.get_mp_group(), "dp_process_group_is_world": smp.get_dp_process_group() is dist.group.WORLD,
        "equal": equal, "gradients_identical_across_ranks": identical_across_ranks(plain_grads[-1]),
        "losses_differ_across_ranks": others[0] != others[-1], "average_of_local_gradients": averaged,
        "received": received}),
        flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
