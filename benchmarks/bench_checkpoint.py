"""Benchmark: acshim per-block checkpointing vs torch.utils.checkpoint per block vs none.

One training step of a GPT-2-shaped model (default 8 layers, width 512, seq 256, batch 4, dropout
on), run side by side in one process, interleaved, with the order rotated every round; reports the
median step time of each configuration, the median of per-round ratios, the memory held for
backward (acshim.measure_memory, by storage) and, with --rss, held/peak RSS measured in a fresh
subprocess per configuration (docs/measuring.md). Target: acshim / torch step time <= 1.02 with
equal held memory.

    python benchmarks/bench_checkpoint.py            # full size (~2-4 minutes on 2 cores)
    python benchmarks/bench_checkpoint.py --small    # quick check
    python benchmarks/bench_checkpoint.py --reentrant            # reentrant regions, both sides
    python benchmarks/bench_checkpoint.py --dialect deepspeed    # acshim's DeepSpeed checkpoint per block
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import acshim
from acshim.testing import GPT, seeded

CONFIGS = ("none", "torch", "acshim")


class TorchCheckpointed(nn.Module):
    """A block run through torch.utils.checkpoint, the baseline acshim must match."""

    def __init__(self, block: nn.Module, reentrant: bool = False) -> None:
        super().__init__()
        self.block = block
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch_checkpoint.checkpoint(self.block, x, use_reentrant=self.reentrant)


class DeepSpeedCheckpointed(nn.Module):
    """A block run as Megatron-DeepSpeed does: DeepSpeed's (reentrant) checkpoint around a closure."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from acshim.facades import deepspeed

        block = self.block

        def custom_forward(hidden: torch.Tensor) -> torch.Tensor:
            return block(hidden)

        return deepspeed.checkpointing.checkpoint(custom_forward, x)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 gives the steadiest ratios)")
    parser.add_argument("--small", action="store_true", help="4 layers, width 128, seq 64, 3 rounds")
    parser.add_argument("--rss", action="store_true", help="also measure RSS in a subprocess per configuration")
    parser.add_argument("--reentrant", action="store_true", help="reentrant regions, torch's and acshim's")
    parser.add_argument("--dialect", choices=("engine", "deepspeed"), default="engine",
                        help="acshim's regions: apply_checkpointing (default), or acshim's DeepSpeed checkpoint "
                             "around a closure per block (reentrant; torch's side then is reentrant too)")
    args = parser.parse_args(argv)
    if args.dialect == "deepspeed":
        args.reentrant = True
    if args.small:
        args.layers, args.width, args.seq, args.rounds = 4, 128, 64, 3
    return args


def build(config: str, args: argparse.Namespace) -> GPT:
    model = seeded(lambda: GPT(layers=args.layers, width=args.width, heads=8, seq=args.seq, vocab=8192))
    if config == "torch":
        for i, block in enumerate(model.h):
            model.h[i] = TorchCheckpointed(block, args.reentrant)
    elif config == "acshim" and args.dialect == "deepspeed":
        for i, block in enumerate(model.h):
            model.h[i] = DeepSpeedCheckpointed(block)
    elif config == "acshim":
        acshim.apply_checkpointing(model, reentrant=args.reentrant)
    return model


def inputs(args: argparse.Namespace) -> torch.Tensor:
    return torch.randint(0, 8192, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))


def forward_step(argv: list[str]) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    """Builder for memory_probe: argv = [config, *benchmark args]."""
    config, args = argv[0], parse(argv[1:])
    torch.set_num_threads(args.threads)
    model, ids = build(config, args), inputs(args)

    def forward() -> torch.Tensor:
        torch.manual_seed(1)
        return model(ids)

    return model, forward


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    args = parse(raw)
    torch.set_num_threads(args.threads)
    ids = inputs(args)
    models = {config: build(config, args) for config in CONFIGS}
    print(f"GPT-2-shaped: {args.layers} layers, width {args.width}, seq {args.seq}, batch {args.batch}; "
          f"{args.rounds} rounds, torch threads {args.threads}, torch {torch.__version__}; "
          f"{'reentrant' if args.reentrant else 'non-reentrant'} regions, acshim via {args.dialect}")

    grads = {}
    for config, model in models.items():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        model(ids).backward()
        grads[config] = [p.grad.clone() for p in model.parameters()]
    equal = all(all(torch.equal(a, b) for a, b in zip(grads["none"], grads[c])) for c in ("torch", "acshim"))
    print(f"gradients bitwise equal to no checkpointing (torch, acshim): {equal}")

    times: dict[str, list[float]] = {c: [] for c in CONFIGS}
    for round_index in range(args.rounds):
        order = CONFIGS[round_index % 3:] + CONFIGS[:round_index % 3]
        for config in order:
            model = models[config]
            model.zero_grad(set_to_none=True)
            torch.manual_seed(1)
            started = time.perf_counter()
            model(ids).backward()
            times[config].append(time.perf_counter() - started)

    held = {c: acshim.measure_memory(build(c, args), ids, loss_fn=lambda loss: loss).held_bytes for c in CONFIGS}
    ratio = [a / t for a, t in zip(times["acshim"], times["torch"])]
    versus_none = {c: statistics.median(x / n for x, n in zip(times[c], times["none"])) for c in CONFIGS}

    print(f"\n{'config':8} {'median step s':>14} {'x none':>8} {'held MiB':>10} {'held x none':>12}")
    for c in CONFIGS:
        print(f"{c:8} {statistics.median(times[c]):14.3f} {versus_none[c]:8.2f} {held[c] / 2**20:10.1f} "
              f"{held[c] / held['none']:12.3f}")
    print(f"\nacshim / torch step time: median of per-round ratios {statistics.median(ratio):.3f} "
          f"(rounds: {', '.join(f'{r:.3f}' for r in ratio)})")
    print(f"acshim / torch held memory: {held['acshim'] / held['torch']:.3f}")

    if args.rss:
        sys.path.insert(0, str(Path(__file__).parent))
        import memory_probe

        print(f"\n{'config':8} {'RSS held MiB':>13} {'RSS peak MiB':>13}")
        for c in CONFIGS:
            figures = memory_probe.probe(__file__, "forward_step", [c, *raw])
            print(f"{c:8} {figures['held_bytes'] / 2**20:13.1f} {figures['peak_bytes'] / 2**20:13.1f}")
    return 0 if equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
