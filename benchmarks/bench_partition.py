"""Benchmark: DeepSpeed ``partition_activations`` on 2 gloo ranks (one model-parallel group, Megatron
style), acshim against real DeepSpeed 0.19.8 on the same config, in one run.

Launches tests/distributed/scripts/deepspeed_partition.py ``--bench`` with torchrun, alternately under
real DeepSpeed (its CPU accelerator) and under ``acshim run``, ``--repeats`` times each. Every rank
reports, for no checkpointing, checkpointing without partition and with partition (reentrant
``deepspeed.checkpointing.checkpoint``): the bytes held for backward (``acshim.measure``: storages
made in forward still referenced when it ends) and the median step time (forward + backward, ranks
synchronised by a barrier). Printed: held bytes per rank and the partition / no-partition ratio for
both implementations, and acshim / DeepSpeed step-time ratios (median over launches of each rank's
median).

    python benchmarks/bench_partition.py            # width 1024, 8 layers, batch 64 (~1-2 minutes)
    python benchmarks/bench_partition.py --small    # quick check
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "distributed" / "scripts" / "deepspeed_partition.py"
BIN = Path(sys.executable).parent
IMPLEMENTATIONS = ("deepspeed", "acshim")
CASES = ("none", "plain", "partition")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--rounds", type=int, default=10, help="timed steps per launch")
    parser.add_argument("--repeats", type=int, default=2, help="launches per implementation, alternating")
    parser.add_argument("--small", action="store_true", help="width 256, 4 layers, batch 16, 5 rounds, 1 repeat")
    args = parser.parse_args(argv)
    if args.small:
        args.width, args.layers, args.batch, args.rounds, args.repeats = 256, 4, 16, 5, 1
    return args


def launch(implementation: str, args: argparse.Namespace) -> list[dict]:
    """One 2-rank torchrun; each rank's ``RESULT`` dict, by rank."""
    prefix = ["--no-python", str(BIN / "acshim"), "run"] if implementation == "acshim" else []
    command = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", *prefix, str(SCRIPT), "--bench",
               "--width", str(args.width), "--layers", str(args.layers), "--batch", str(args.batch),
               "--dropout", str(args.dropout), "--rounds", str(args.rounds)]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{implementation} launch failed:\n{done.stderr[-3000:]}")
    decoder = json.JSONDecoder()
    found = [decoder.raw_decode(chunk)[0] for chunk in done.stdout.split("RESULT ")[1:]]
    return [r["results"] for r in sorted(found, key=lambda r: r["rank"])]


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    print(f"2 gloo ranks, one model-parallel group; {args.layers} blocks of width {args.width}, batch {args.batch}, "
          f"dropout {args.dropout}; {args.rounds} steps x {args.repeats} launches per implementation")
    runs: dict[str, list[list[dict]]] = {name: [] for name in IMPLEMENTATIONS}
    for _ in range(args.repeats):
        for name in IMPLEMENTATIONS:
            runs[name].append(launch(name, args))

    def held(name: str, case: str, rank: int) -> int:
        return runs[name][0][rank][case]["held"]

    def step(name: str, case: str) -> float:
        return statistics.median(run[rank][case]["step"] for run in runs[name] for rank in range(2))

    print(f"\n{'':10} {'case':10} {'held/rank 0 KiB':>16} {'held/rank 1 KiB':>16} {'x plain':>8} {'step ms':>9}")
    for name in IMPLEMENTATIONS:
        for case in CASES:
            ratio = held(name, case, 0) / held(name, "plain", 0)
            print(f"{name:10} {case:10} {held(name, case, 0) / 1024:16.1f} {held(name, case, 1) / 1024:16.1f} "
                  f"{ratio:8.3f} {step(name, case) * 1e3:9.1f}")
    print()
    for name in IMPLEMENTATIONS:
        print(f"{name}: held per rank, partition / no partition (checkpointed): "
              f"{held(name, 'partition', 0) / held(name, 'plain', 0):.3f}")
    print(f"acshim / deepspeed held per rank with partition: "
          f"{held('acshim', 'partition', 0) / held('deepspeed', 'partition', 0):.3f}")
    for case in CASES:
        print(f"acshim / deepspeed step time, {case}: {step('acshim', case) / step('deepspeed', case):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
