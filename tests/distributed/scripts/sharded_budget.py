"""A sharded training script, run by tests/distributed as
``torchrun ... -m acshim run --budget B sharded_budget.py --engine fsdp1|fsdp2|zero3 [--rows R,R,...] [--blocks N]
[--planned-only]``: the same steps (dropout on, one batch per entry of ``--rows``) without
checkpointing and then with it (only with it, ``--planned-only``: for a run that is to end before
its results, refused or ``acshim plan``), on the same engine: FSDP2 (``fully_shard`` per block and
on the root, torch's ``checkpoint_wrapper`` on the blocks), FSDP1 (``FullyShardedDataParallel`` wrapping each block and
the root, ``use_orig_params``, the same ``checkpoint_wrapper``) or a DeepSpeed engine at ZeRO-3 (``deepspeed.checkpointing.
checkpoint`` in the model's forward). Every rank prints ``RESULT {json}``: whether the full weights
are bitwise equal, the plan, and each checkpointed step's peak as the kernel saw it (``VmHWM``
reset before the step, above the resident set at its start; the optimizer's step excluded), and
those of the run without checkpointing (``none``)."""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from ddp_budget import Block  # this folder is the script's: sys.path[0]
from torch import nn

WIDTH = 256
BLOCKS = 4


class Net(nn.Module):
    def __init__(self, checkpoint: str) -> None:
        super().__init__()
        self.stem = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, 1)
        self.checkpoint = checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            if self.checkpoint == "deepspeed":
                import deepspeed

                x = deepspeed.checkpointing.checkpoint(block, x)
            else:
                x = block(x)
        return self.head(x).pow(2).mean()


def _kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _step_start() -> int:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as refs:  # the high-water mark restarts from the resident set
        refs.write("5")
    # less the freed blocks acshim's CPU allocator keeps for the planned steps (resident, reused)
    allocator = sys.modules.get("acshim.host_allocator")
    return _kib("VmRSS") - (allocator.cached() if allocator is not None else 0)


def _stepper(optimizer: torch.optim.Optimizer) -> Callable[..., None]:
    """A torch-optimizer step: backward, the step's VmHWM above ``start`` appended to ``measure``, step."""

    def backward_and_step(loss: torch.Tensor, measure: list[int] | None, start: int) -> None:
        loss.backward()
        if measure is not None:
            measure.append(_kib("VmHWM") - start)
        optimizer.step()
        optimizer.zero_grad()

    return backward_and_step


def fsdp2(checkpointed: bool) -> tuple[nn.Module, nn.Module, Callable[..., None]]:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Net("module")
    if checkpointed:
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper),
                                       check_fn=lambda module: isinstance(module, Block))
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    return model, model, _stepper(optimizer)


def fsdp1(checkpointed: bool) -> tuple[nn.Module, nn.Module, Callable[..., None]]:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    model = Net("module")
    wrapped = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True,
                                       device_id=torch.device("cpu"))
    if checkpointed:
        apply_activation_checkpointing(wrapped, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper),
                                       check_fn=lambda module: isinstance(module, Block))
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.01)

    return wrapped, wrapped, _stepper(optimizer)


def fsdp1_weights(model: nn.Module) -> list[torch.Tensor]:
    from torch.distributed.fsdp import FullyShardedDataParallel

    with FullyShardedDataParallel.summon_full_params(model):
        return [p.detach().clone() for p in model.parameters()]


def fsdp2_weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def zero3(checkpointed: bool) -> tuple[nn.Module, nn.Module, Callable[..., None]]:
    import deepspeed

    config = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1,
              "optimizer": {"type": "SGD", "params": {"lr": 0.01}}, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 3}}
    torch.manual_seed(0)
    model = Net("deepspeed" if checkpointed else "none")
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    if checkpointed:
        deepspeed.checkpointing.configure(None, deepspeed_config=config)

    def backward_and_step(loss: torch.Tensor, measure: list[int] | None, start: int) -> None:
        engine.backward(loss)
        if measure is not None:
            measure.append(_kib("VmHWM") - start)
        engine.step()

    return engine, engine.module, backward_and_step


def zero3_weights(model: nn.Module) -> list[torch.Tensor]:
    import deepspeed

    parameters = list(model.parameters())
    with deepspeed.zero.GatheredParameters(parameters):
        return [p.detach().clone() for p in parameters]


def train(engine: str, checkpointed: bool, rows: list[int], peaks: list[int] | None) -> list[torch.Tensor]:
    """The steps; the full weights after them."""
    runner, module, backward_and_step = {"fsdp1": fsdp1, "fsdp2": fsdp2, "zero3": zero3}[engine](checkpointed)
    generator = torch.Generator().manual_seed(dist.get_rank())
    batches = [torch.randn(count, WIDTH, generator=generator) for count in rows]
    torch.manual_seed(1000 + dist.get_rank())
    for batch in batches:
        start = _step_start()
        backward_and_step(runner(batch), peaks, start)
    weights = {"fsdp1": fsdp1_weights, "fsdp2": fsdp2_weights, "zero3": zero3_weights}[engine](module)
    if engine == "zero3":
        runner.destroy()
    return weights


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", choices=("fsdp1", "fsdp2", "zero3"), required=True)
    parser.add_argument("--rows", default="2048,2048,2048,2048")
    parser.add_argument("--blocks", type=int, default=BLOCKS)
    parser.add_argument("--planned-only", action="store_true", help="skip the run without checkpointing")
    args = parser.parse_args()
    globals()["BLOCKS"] = args.blocks
    if args.engine == "zero3":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rows = [int(count) for count in args.rows.split(",")]
    import acshim

    sessions = list(acshim.region.ROUTERS)
    none: list[int] = []
    reference = unplanned(lambda: train(args.engine, False, rows, none)) if not args.planned_only else None
    peaks: list[int] = []
    weights = train(args.engine, True, rows, peaks)
    equal = reference is not None and all(torch.equal(a, b) for a, b in zip(weights, reference, strict=True))
    result = {"rank": dist.get_rank(), "equal": equal,
              "finite": all(bool(w.isfinite().all()) for w in weights), "peaks": peaks, "none": none}
    if sessions and sessions[0].plan is not None:
        session = sessions[0]
        result.update(choices=session.plan.choices, budget=session.plan.budget, reference=session.plan.reference_peak,
                      measured=session._lockstep.peaks if session._lockstep else None, replans=session.replans,
                      offered=session.plan.profile.choices, predicted=session.plan.peak + session.plan.overhead,
                      explored=session._lockstep.explore_steps if session._lockstep else None,
                      skipped=session._lockstep.skipped if session._lockstep else None)
    report(result)


def unplanned(run: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
    """``run()`` with acshim's planning sessions set aside: the run without checkpointing goes unplanned."""
    import acshim

    sessions = list(acshim.region.ROUTERS)
    for session in sessions:
        acshim.region.ROUTERS.remove(session)
    try:
        return run()
    finally:
        acshim.region.ROUTERS.extend(sessions)


def report(result: dict[str, object]) -> None:
    """Print this rank's ``RESULT`` line, then end the process group cleanly."""
    print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    from acshim.exit_settle import settle_collective_threads

    settle_collective_threads()


if __name__ == "__main__":
    main()
