"""Benchmark: the memory-budget planner (acshim.plan) beside the fixed recipes.

One GPT-2-shaped model (default 8 layers x 512, seq 256, batch 2, vocab 512 as in
benchmarks/bench_checkpoint.py, dropout on), one process, configurations interleaved with the order rotated every round. Per configuration: bytes
held for backward when forward ends and the step's peak activation memory (acshim.planner.measure_step:
live storages op by op, parameter gradients and inputs excluded), as ratios of no checkpointing's,
and the median of per-round step-time ratios. Configurations: none, full recompute per block,
selective-op (save matmul/attention outputs), disk offload alone around the step (prefetch 2), and
plans at several peak budgets (fractions of none's measured peak). Also: planning time (profiling +
solving + verification) in steps of none, each plan's own prediction (peak and step time as ratios
of its predicted no checkpointing) beside what was measured, and the planner's predicted frontier.

    python benchmarks/bench_planner.py            # full size
    python benchmarks/bench_planner.py --small    # quick check
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

import acshim
from acshim.planner import measure_step
from acshim.selective import save_ops
from acshim.testing import GPT, seeded


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--budgets", default="0.7,0.47,0.35,0.23,0.16",
                        help="peak budgets as fractions of no checkpointing's measured peak")
    parser.add_argument("--small", action="store_true", help="4 layers, width 128, seq 64, vocab 512, 3 rounds")
    args = parser.parse_args(argv)
    if args.small:
        args.layers, args.width, args.seq, args.vocab, args.rounds = 4, 128, 64, 512, 3
    return args


Step = Callable[[], None]


def make_step(model: GPT, ids: torch.Tensor, scope: Callable[[], Any] = nullcontext) -> Step:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        with scope():
            loss = model(ids)
        loss.backward()
    return step


def measure(model: GPT, ids: torch.Tensor, scope: Callable[[], Any] = nullcontext) -> tuple[int, int]:
    model.zero_grad(set_to_none=True)
    if scope is nullcontext:
        return measure_step(model, ids)

    class Scoped(torch.nn.Module):  # the offload scope around forward only, as a user would write it
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with scope():
                return self.inner(x)

    return measure_step(Scoped(), ids)


def main(argv: list[str]) -> None:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    model = seeded(lambda: GPT(args.layers, args.width, max(1, args.width // 64), args.seq, args.vocab))
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    offload_scope = lambda: acshim.offload(storage="disk", prefetch=2)  # noqa: E731

    # Fixed recipes: install, measure memory, keep a step closure that re-installs its recipe.
    recipes: dict[str, tuple[Callable[[], None], Callable[[], Any]]] = {
        "none": (lambda: acshim.remove_checkpointing(model), nullcontext),
        "full recompute": (lambda: acshim.apply_checkpointing(model), nullcontext),
        "selective-op": (lambda: acshim.apply_checkpointing(model, context_fn=save_ops()), nullcontext),
        "disk offload alone": (lambda: acshim.remove_checkpointing(model), offload_scope),
    }
    memory: dict[str, tuple[int, int]] = {}
    for name, (install, scope) in recipes.items():
        install()
        make_step(model, ids, scope)()  # warm up
        memory[name] = measure(model, ids, scope)
    acshim.remove_checkpointing(model)
    none_held, none_peak = memory["none"]
    step_none = make_step(model, ids)
    start = time.perf_counter()
    step_none()
    none_seconds = time.perf_counter() - start

    plans = {}
    fractions = [float(f) for f in args.budgets.split(",")]
    start = time.perf_counter()
    first = None
    for fraction in fractions:
        budget = int(fraction * none_peak)
        try:
            found = acshim.plan(model, ids, budget=budget, reuse=first)
        except ValueError as error:
            print(f"budget {fraction:.2f}x: {error}")
            continue
        if first is None:
            first = found
            planning_seconds = time.perf_counter() - start
        plans[f"plan @ {fraction:.2f}x"] = found
    for name, found in plans.items():
        found.apply(model)
        make_step(model, ids)()
        memory[name] = measure(model, ids)
        acshim.remove_checkpointing(model)

    def installer(name: str) -> tuple[Callable[[], None], Callable[[], Any]]:
        if name in recipes:
            return recipes[name]
        return (lambda: plans[name].apply(model)), nullcontext

    names = list(memory)
    ratios: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(args.rounds):
        order = names[round_index % len(names):] + names[:round_index % len(names)]
        seconds = {}
        for name in order:
            install, scope = installer(name)
            acshim.remove_checkpointing(model)
            install()
            step = make_step(model, ids, scope)
            start = time.perf_counter()
            step()
            seconds[name] = time.perf_counter() - start
        for name in names:
            ratios[name].append(seconds[name] / seconds["none"])
    acshim.remove_checkpointing(model)

    print(f"GPT {args.layers}x{args.width}, batch {args.batch}x{args.seq}, vocab {args.vocab}, dropout on; "
          f"torch {torch.__version__}, {args.threads} thread(s), {args.rounds} rounds")
    print(f"no checkpointing: held {none_held / 2**20:.1f} MiB, peak {none_peak / 2**20:.1f} MiB")
    print(f"{'configuration':<22} {'held x':>7} {'peak x':>7} {'step x':>7}  {'within budget':>13}  "
          f"{'predicted peak x, step x':>24}  choices")
    for name in names:
        held, peak = memory[name]
        found = plans.get(name)
        within = "" if found is None else ("yes" if peak <= found.budget else "NO")
        choices = "" if found is None else " ".join(_short(c) for c in found.choices)
        # the planner's own prediction, as ratios of its predicted no checkpointing (never run)
        predicted = "" if found is None else (f"{found.peak / found.reference_peak:.2f}, "
                                              f"{found.seconds / found.reference_seconds:.2f}")
        print(f"{name:<22} {held / none_held:>7.2f} {peak / none_peak:>7.2f} "
              f"{statistics.median(ratios[name]):>7.2f}  {within:>13}  {predicted:>24}  {choices}")
    if first is not None:
        print(f"planning (profile + solve + verify): {planning_seconds:.1f} s = "
              f"{planning_seconds / none_seconds:.1f} steps of no checkpointing")
        print("predicted frontier (budget x, peak x, step x of predicted no checkpointing):")
        for point in first.frontier():
            print(f"  {point.budget / first.reference_peak:.2f}  {point.peak / first.reference_peak:.2f}  "
                  f"{point.seconds / first.reference_seconds:.2f}  {' '.join(_short(c) for c in point.choices)}")


def _short(choice: str) -> str:
    return {"keep": "K", "selective": "S", "selective-alt": "S2", "recompute": "R", "offload:disk": "Od",
            "offload:host": "Oh", "recompute+offload:disk": "ROd", "recompute+offload:host": "ROh"}.get(choice, choice)


if __name__ == "__main__":
    main(sys.argv[1:])
