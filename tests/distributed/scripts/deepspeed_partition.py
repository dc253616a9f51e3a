"""DeepSpeed ``partition_activations`` across a model-parallel group of every rank (2 here), Megatron
style: ``deepspeed.checkpointing.configure(mpu, partition_activations=True, ...)`` with an ``mpu``
offering ``get_model_parallel_rank/world_size/group``, dropout inside ``get_cuda_rng_tracker().fork()``.
Run as it is (real DeepSpeed 0.19.8 on its CPU accelerator, gloo) or under ``acshim run``; every rank
prints one ``RESULT {json}`` line.

Parity mode (default): for each case (no checkpointing; checkpointing without partition; partition;
+contiguous buffers; +cpu_checkpointing; all three) and each of ``checkpoint`` /
``non_reentrant_checkpoint``, one training step per dropout setting: a digest of the parameter
gradients, the bytes held for backward (``acshim.measure.measure_memory``: storages made in forward
and still referenced when it ends), and the stem output's shape after forward and after backward
(upstream empties it to ``()`` and gathers it back). Then the mp edge cases: a checkpoint input
whose size does not split across the ranks, one smaller than the group (kept whole), an integer mask
(never partitioned), more checkpoints than ``num_checkpoints``.

Bench mode (``--bench``): a bigger model; held bytes and the median step time for no partition and
partition (benchmarks/bench_partition.py runs it under both implementations).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import statistics
import time

import deepspeed
import torch
import torch.distributed as dist
from torch import nn

from acshim.measure import measure_memory

checkpointing = deepspeed.checkpointing
MEASUREMENTS = 3

CASES = {
    "plain": {},
    "partition": {"partition_activations": True},
    "contiguous": {"partition_activations": True, "contiguous_checkpointing": True},
    "cpu": {"partition_activations": True, "checkpoint_in_cpu": True},
    "cpu_contiguous": {"partition_activations": True, "contiguous_checkpointing": True, "checkpoint_in_cpu": True},
}


class ModelParallelUnit:
    """Megatron's legacy mpu: every rank in one model-parallel group, data parallel size 1."""

    def __init__(self) -> None:
        self.group = dist.new_group(list(range(dist.get_world_size())))

    def get_model_parallel_rank(self) -> int:
        return dist.get_rank(self.group)

    def get_model_parallel_world_size(self) -> int:
        return dist.get_world_size(self.group)

    def get_model_parallel_group(self):
        return self.group

    def get_data_parallel_rank(self) -> int:
        return 0

    def get_data_parallel_world_size(self) -> int:
        return 1

    def get_data_parallel_group(self):
        return None


class ReduceFromModelParallelRegion(torch.autograd.Function):
    """Megatron's row-parallel reduction (mpu/mappings.py): all-reduce (sum) over the model-parallel
    group in forward, identity in backward. It makes each block's output the same on every rank, which
    partition_activations assumes of checkpoint inputs."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, group) -> torch.Tensor:
        hidden = hidden.clone()
        dist.all_reduce(hidden, group=group)
        return hidden

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class Block(nn.Module):
    """Megatron's pattern: dropout on the rank's own stream (``get_cuda_rng_tracker().fork()``: its
    seed differs per model-parallel rank) before the row-parallel reduction, hidden dropout on the
    default generator (seeded alike on every rank) after it."""

    def __init__(self, width: int, dropout: float, group) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.attention_dropout = nn.Dropout(dropout)
        self.hidden_dropout = nn.Dropout(dropout)
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = self.linear(hidden)
        with checkpointing.get_cuda_rng_tracker().fork():
            hidden = self.attention_dropout(hidden)
        hidden = ReduceFromModelParallelRegion.apply(hidden, self.group)
        return torch.tanh(self.hidden_dropout(hidden))


class Net(nn.Module):
    def __init__(self, width: int, layers: int, dropout: float, mode: str, group) -> None:
        super().__init__()
        self.stem = nn.Linear(width, width)
        self.blocks = nn.ModuleList(Block(width, dropout, group) for _ in range(layers))
        self.mode = mode  # "none", "checkpoint" or "non_reentrant_checkpoint"
        self.stem_shapes: list[list[int]] = []
        self.stem_output: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.stem_output = self.stem(x)  # the caller keeps it, as Megatron does
        for block in self.blocks:
            hidden = block(hidden) if self.mode == "none" else getattr(checkpointing, self.mode)(block, hidden)
        self.stem_shapes.append(list(self.stem_output.shape))
        return hidden


def loss_of(output: torch.Tensor) -> torch.Tensor:
    return output.mean()  # saves nothing: what is held for backward is the blocks' own


def settled_loss(group):
    """``loss_of`` once what is no longer needed is gone: a barrier on the model-parallel group
    (gloo's worker may hold the last all-reduce's buffer after the call returns; almost always it
    has dropped it by the time the barrier is done, ``run_case`` covers the rest) and a garbage
    collection (unreachable cycles holding tensors)."""
    def loss(output: torch.Tensor) -> torch.Tensor:
        dist.barrier(group=group)
        gc.collect()
        return loss_of(output)

    return loss


def digest(model: nn.Module) -> str:
    return hashlib.sha256(b"".join(p.grad.numpy().tobytes() for p in model.parameters())).hexdigest()


def build(args: argparse.Namespace, mpu: ModelParallelUnit, mode: str, dropout: float) -> tuple[Net, torch.Tensor]:
    torch.manual_seed(0)
    model = Net(args.width, args.layers, dropout, mode, mpu.group)
    torch.manual_seed(7)  # the same activations on every model-parallel rank, as in Megatron
    x = torch.randn(args.batch, args.width)
    checkpointing.model_parallel_cuda_manual_seed(1234)
    return model, x


def configure(mpu: ModelParallelUnit, case: str, layers: int) -> None:
    flags = dict(CASES.get(case, {}))
    if flags.get("contiguous_checkpointing"):
        flags["num_checkpoints"] = layers
    checkpointing.configure(mpu, **flags)


def run_case(args: argparse.Namespace, mpu: ModelParallelUnit, case: str, mode: str, dropout: float) -> dict:
    """One step, taken ``MEASUREMENTS`` times from the same seeds (the same gradients every time, or
    this raises); ``held`` is the least of them: gloo's worker thread drops its reference to an
    all-reduce's tensor only after marking the work done, so a barrier may return while it still
    holds the last block's reduced output, and a step measured right then counts it as held."""
    results = []
    for _ in range(MEASUREMENTS):
        configure(mpu, case, args.layers)
        model, x = build(args, mpu, "none" if case == "none" else mode, dropout)
        report = measure_memory(model, x, loss_fn=settled_loss(mpu.group), blocks=[])
        model.stem_shapes.append(list(model.stem_output.shape))
        checkpointing.reset()
        results.append({"grads": digest(model), "held": report.held_bytes, "stem_shapes": model.stem_shapes})
    if any(result["grads"] != results[0]["grads"] for result in results):
        raise RuntimeError(f"{case}/{mode}/{dropout}: the same step from the same seeds gave different gradients")
    return {**results[0], "held": min(result["held"] for result in results)}


def error_of(call) -> str | None:
    try:
        call()
    except Exception as error:  # the type and text are the result
        return f"{type(error).__name__}: {error}"
    return None


def edge_cases(mpu: ModelParallelUnit) -> dict:
    checkpointing.configure(mpu, partition_activations=True)
    linear = nn.Linear(5, 5)
    odd = torch.randn(3, 5, requires_grad=True)  # 15 elements: not divisible by 2
    results = {"odd": error_of(lambda: checkpointing.checkpoint(linear, odd))}

    torch.manual_seed(3)
    x = torch.randn(4, 5, requires_grad=True)
    scale = torch.full((1,), 0.5, requires_grad=True)  # fewer elements than ranks: kept whole
    mask = torch.tensor([1, 0, 1, 1, 0])  # an integer tensor: never partitioned

    def function(h: torch.Tensor, s: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return linear(h) * s * m

    hidden = x * 1.0
    out = checkpointing.checkpoint(function, hidden, scale, mask)
    results["small_shapes_after_forward"] = [list(hidden.shape), list(scale.shape), list(mask.shape)]
    out.sum().backward()
    results["small_shapes_after_backward"] = [list(hidden.shape), list(scale.shape), list(mask.shape)]
    results["small_grads"] = hashlib.sha256(x.grad.numpy().tobytes() + scale.grad.numpy().tobytes()).hexdigest()

    checkpointing.configure(mpu, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=2)
    hidden = x * 1.0
    for _ in range(2):
        hidden = checkpointing.checkpoint(linear, hidden)
    results["past_num_checkpoints"] = error_of(lambda: checkpointing.checkpoint(linear, hidden))
    results["contiguous_buffers"] = [len(buffers) for buffers in checkpointing.contiguous_data_buffers]
    checkpointing.reset()
    results["after_reset"] = len(checkpointing.contiguous_data_buffers)
    return results


def parity(args: argparse.Namespace, mpu: ModelParallelUnit) -> dict:
    results: dict = {}
    for dropout in (0.0, 0.1):
        results[f"none/{dropout}"] = run_case(args, mpu, "none", "none", dropout)
        for mode in ("checkpoint", "non_reentrant_checkpoint"):
            for case in CASES:
                results[f"{case}/{mode}/{dropout}"] = run_case(args, mpu, case, mode, dropout)
    results["edges"] = edge_cases(mpu)
    return results


def bench(args: argparse.Namespace, mpu: ModelParallelUnit) -> dict:
    results = {}
    for case in ("none", "plain", "partition"):
        configure(mpu, case, args.layers)
        model, x = build(args, mpu, "none" if case == "none" else "checkpoint", args.dropout)
        held = measure_memory(model, x, loss_fn=settled_loss(mpu.group), blocks=[]).held_bytes
        times = []
        for _ in range(args.rounds):
            model.zero_grad()
            dist.barrier()
            start = time.perf_counter()
            loss_of(model(x)).backward()
            times.append(time.perf_counter() - start)
        results[case] = {"held": held, "step": statistics.median(times)}
        checkpointing.reset()
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bench", action="store_true")
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    deepspeed.init_distributed(dist_backend="gloo")
    mpu = ModelParallelUnit()
    results = bench(args, mpu) if args.bench else parity(args, mpu)
    print("RESULT " + json.dumps({"rank": dist.get_rank(), "results": results}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
