"""An SMP v1 pipeline-parallel training script (``pipeline_parallel_degree`` 2), written only against
the SMP v1 API and torch, run under ``torchrun -m acshim run`` by tests/distributed/test_smp_v1_pipeline.py.

Each case builds the same model with the same seed, trains it two steps (SGD) through
``smp.DistributedModel`` / ``@smp.step`` / ``model.backward`` / ``smp.DistributedOptimizer``, and
compares on global rank 0, bitwise, every parameter's gradient (each stage sends the gradients of
the parameters it owns), the losses and the final state dict with the same model trained on one
process without SMP, with the same microbatch split and microbatch gradients summed in order.
With ``--replicas 2`` (4 ranks) each data-parallel replica has its own data and the reference
averages the two replicas' gradients. Prints one ``RESULT {json}`` line per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import warnings
from dataclasses import dataclass

import smdistributed.modelparallel.torch as smp
import torch
from smdistributed.modelparallel.torch.patches.checkpoint import checkpoint, checkpoint_sequential
from torch import nn

WIDTH, BATCH, MICROBATCHES, STEPS = 8, 8, 2, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.dropout = nn.Dropout(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.linear(x)).tanh() + x


@dataclass
class HeadOutput:
    y: torch.Tensor
    calls: int


class Head(nn.Module):
    """Takes a keyword argument and returns a dataclass with a non-tensor field (nested values cross stages)."""

    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor, *, scale: float) -> HeadOutput:
        return HeadOutput(self.out(x) * scale, 1)


class Net(nn.Module):
    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.Sequential(*(Block() for _ in range(4)))
        self.act = nn.ReLU(inplace=True)  # in place on its input, which may arrive from another stage
        self.head = Head()
        if manual:  # smp.partition places modules created inside; reassigning keeps the attribute order
            with smp.partition(1):
                self.blocks[2], self.blocks[3], self.head = Block(), Block(), Head()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.blocks(self.embed(x))), scale=0.5).y


class Body(nn.Module):
    """Not an nn.Sequential: automatic partitioning may open it and split its children."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = Block(), Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


class InlineNet(Net):
    """Net checkpointed from its own forward: ``checkpoint`` on a module of either stage (placed by
    hand, the head is on stage 1, so its region runs there) and ``checkpoint_sequential`` over the
    blocks, which span both stages (group_3 cut at the boundary: (0, 1) and (2, 3))."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.embed, x)
        h = checkpoint_sequential(self.blocks, h, strategy="group_3")
        return checkpoint(self.head, self.act(h), scale=0.5).y


class SplitNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = Body()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def data(step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + smp.dp_rank())
    return torch.randn(BATCH, WIDTH, generator=generator)


def build(kind: str, manual: bool = False) -> nn.Module:
    torch.manual_seed(0)
    if kind == "split":
        return SplitNet()
    return InlineNet(manual) if kind == "inline" else Net(manual)


def reference(kind: str, replicas: int, manual: bool) -> tuple[list[float], list[dict[str, torch.Tensor]], nn.Module]:
    """One process, no SMP: per step and replica, microbatch gradients summed in order and divided
    by their number, then summed over the replicas and divided by their number."""
    net = build(kind, manual)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    losses, gradients = [], []
    for step in range(STEPS):
        per_replica = []
        for replica in range(replicas):
            torch.manual_seed(7 + step)  # dropout stream of this step (every replica seeds the same)
            generator = torch.Generator().manual_seed(1000 * step + replica)
            x = torch.randn(BATCH, WIDTH, generator=generator)
            net.zero_grad(set_to_none=True)
            step_losses = []
            for chunk in x.chunk(MICROBATCHES):
                loss = loss_of(net(chunk))
                loss.backward()
                step_losses.append(loss.detach())
            per_replica.append({n: p.grad / MICROBATCHES for n, p in net.named_parameters()})
            if replica == smp.dp_rank():
                losses.append((sum(step_losses) / MICROBATCHES).item())
        averaged = {n: per_replica[0][n] for n in per_replica[0]}
        if replicas > 1:
            averaged = {n: sum(r[n] for r in per_replica) / replicas for n in averaged}
        gradients.append(averaged)
        for name, parameter in net.named_parameters():
            parameter.grad = averaged[name]
        optimizer.step()
    return losses, gradients, net


@smp.step
def eval_step(model: smp.DistributedModel, x: torch.Tensor) -> torch.Tensor:
    return model(x)


@smp.step
def train_step(model: smp.DistributedModel, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = model(x)
    loss = loss_of(out)
    model.backward(loss)
    return loss, out


def gathered_gradients(model: smp.DistributedModel) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, each from the stage that owns it."""
    local = {n: p.grad.clone() for n, p in model.local_named_parameters() if p.grad is not None}
    merged: dict[str, torch.Tensor] = {}
    for part in smp.allgather(local, smp.PP_GROUP):
        merged.update(part)
    return merged


def checkpoint_blocks(net: nn.Module, how: str) -> None:
    if how == "each_block":
        for block in net.blocks:
            smp.set_activation_checkpointing(block)
    elif how.startswith("sequential_"):
        smp.set_activation_checkpointing(net.blocks, strategy=how.removeprefix("sequential_"))
    elif how == "split_body":
        smp.set_activation_checkpointing(net.body)


def run_case(name: str, config: dict, kind: str = "net", checkpointing: str = "none") -> dict:
    smp.init({"pipeline_parallel_degree": 2, "microbatches": MICROBATCHES, "ddp": True, **config})
    manual = not smp.state.cfg.auto_partition
    net = build(kind, manual)
    model = smp.DistributedModel(net)
    checkpoint_blocks(net, checkpointing)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    losses, gradients, outputs_match = [], [], True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            torch.manual_seed(7 + step)
            x = data(step)
            optimizer.zero_grad()
            loss, out = train_step(model, x)
            losses.append(loss.reduce_mean().item())
            outputs_match &= out.concat().shape[0] == BATCH and len(out.outputs) == MICROBATCHES
            gradients.append(gathered_gradients(model))
            optimizer.step()
    state = model.state_dict()  # a collective: every stage contributes what it owns
    model.eval()
    with torch.no_grad():  # a forward-only step: no graph kept on any stage
        evaluated = eval_step(model, data(9)).concat()
    replicas = smp.dp_size()
    smp.reset()  # the one-process reference below runs outside the pipelined model
    expected_losses, expected_gradients, trained = reference(kind, replicas, manual)
    expected_state = trained.state_dict()
    trained.eval()
    with torch.no_grad():  # the same microbatch split: one 8-row forward's last bits differed from two 4-row ones (AMX Xeon)
        expected_eval = torch.cat([trained(chunk) for chunk in data(9).chunk(MICROBATCHES)])
    result = {
        "losses_equal": losses == expected_losses,
        "gradients_equal": all(
            got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
            for got, want in zip(gradients, expected_gradients)),
        "state_dict_equal": state.keys() == expected_state.keys()
        and all(torch.equal(state[k], expected_state[k]) for k in state),
        "outputs": outputs_match,
        "eval_equal": torch.equal(evaluated, expected_eval),
        "local_parameters": sorted(n for n, _ in model.local_named_parameters()),
        "others_released": all(p.numel() == 0 for n, p in net.named_parameters()
                               if n not in dict(model.local_named_parameters())),
        "optimizer_parameters": sum(len(g["params"]) for g in optimizer.param_groups),
        "warnings": [str(w.message) for w in caught if "checkpointed" in str(w.message)],
    }
    if name == "auto":
        result["reload_equal"] = save_and_reload(model, optimizer, state)
    return result


def save_and_reload(model: smp.DistributedModel, optimizer: smp.DistributedOptimizer,
                    state: dict[str, torch.Tensor]) -> bool:
    """smp.save the gathered state on rank 0, smp.load it into a new model and optimizer."""
    optimizer_state = optimizer.state_dict()
    directory = smp.allgather(tempfile.mkdtemp() if smp.rank() == 0 else None, smp.WORLD)[0]
    path = os.path.join(directory, "model.pt")
    if smp.rank() == 0:
        smp.save({"model": state, "optimizer": optimizer_state}, path)
    smp.barrier()
    loaded = smp.load(path)
    smp.barrier()
    if smp.rank() == 0:
        os.remove(path)
        os.rmdir(directory)
    smp.init({"pipeline_parallel_degree": 2, "microbatches": MICROBATCHES, "ddp": True})
    torch.manual_seed(123)  # other initial weights, replaced by the load
    fresh = smp.DistributedModel(Net())
    fresh_optimizer = smp.DistributedOptimizer(torch.optim.SGD(fresh.parameters(), lr=0.1))
    torch.manual_seed(7)
    train_step(fresh, data(0))  # partitions the model (and trains a step, undone by the load)
    fresh.load_state_dict(loaded["model"])
    fresh_optimizer.load_state_dict(loaded["optimizer"])
    reloaded = fresh.state_dict()
    return all(torch.equal(reloaded[k], state[k]) for k in state)


CASES = {
    "auto": ({}, "net", "none"),
    "auto_each_block": ({}, "net", "each_block"),
    "auto_contiguous": ({"pipeline": "simple"}, "net", "sequential_contiguous"),
    "manual_group_3": ({"auto_partition": False, "default_partition": 0}, "net", "sequential_group_3"),
    "auto_split": ({}, "split", "split_body"),
    "manual_in_forward": ({"auto_partition": False, "default_partition": 0}, "inline", "none"),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    results = {name: run_case(name, *CASES[name]) for name in args.cases.split(",")}
    print("RESULT " + json.dumps({
        "rank": smp.rank(), "pp_rank": smp.pp_rank(), "pp_size": smp.pp_size(), "dp_rank": smp.dp_rank(),
        "dp_size": smp.dp_size(), "pp_group": smp.get_pp_group(), "dp_group": smp.get_dp_group(),
        "cases": results}), flush=True)


if __name__ == "__main__":
    main()
