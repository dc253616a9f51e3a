"""Benchmark: ``acshim run --budget`` on a sharded model, 2 gloo ranks, beside no checkpointing and
full recompute on the same engine.

Model: Hugging Face ``GPT2LMHeadModel`` 8 x 512, batch 2 x 256 per rank, vocab 512, dropout on,
random weights; ``--engine fsdp2``: ``fully_shard`` on every block and the root, ``--engine zero3``:
a DeepSpeed engine at ZeRO-3 (DeepSpeed's CPU accelerator). Every configuration is one
``torchrun --nproc-per-node 2`` run of this file's ``--child`` mode, ``--steps`` SGD steps:

- ``none``: no checkpointing; ``full recompute``: the script's ``gradient_checkpointing_enable()``
  (every block recomputed, through acshim); ``plan @ f``: the same script under
  ``-m acshim run --budget f`` (the planner replaces the recompute recipe).
- peak: per step, ``VmHWM`` reset before it (``/proc/self/clear_refs``) above the resident set at
  its start, the optimizer's step excluded; the largest over the steps after the first and over
  ranks (planning's second explored step included). The first step is shown on its own: an engine
  allocates its gradient buffers there (ZeRO-3: 143 MiB at the end of its first backward on this
  model), which is the baseline of every later step, as docs/measuring.md's warm-up step.
- step time: the slowest rank's, median of the steps after the plan is verified (after the explored
  steps, up to six, and the verified one; step 4 on for the fixed recipes).
- rounds: the configurations run one after another, the order rotated each round; ratios to ``none``
  are per round, the median is reported.
- checks: the full weights after the steps equal ``none``'s bitwise (every configuration); the
  plan's peak within its budget in bytes (as the planner fixed it).

``--load both`` (default): idle, then with a busy-loop process on one core (started and killed here).

    MALLOC_MMAP_THRESHOLD_=65536 python benchmarks/bench_sharded.py --engine fsdp2
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
MiB = 2**20


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("fsdp2", "zero3"), default="fsdp2")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budgets", default="0.6,0.4")
    parser.add_argument("--load", choices=("both", "idle", "busy"), default="both")
    parser.add_argument("--busy-seconds", type=int, default=3600)
    parser.add_argument("--child", choices=("none", "recompute"), default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------------------ child
def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field + ":"))


def _step_start() -> int:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    return _status("VmRSS")


def child(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import transformers

    if args.engine == "zero3":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    config = transformers.GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=max(1, args.width // 64),
                                     n_positions=args.seq, vocab_size=args.vocab, use_cache=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    model.train()
    if args.child == "recompute":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        runner = model

        def backward_and_step(loss: Any) -> None:
            loss.backward()

        def step() -> None:
            optimizer.step()
            optimizer.zero_grad()
    else:
        import deepspeed

        ds = {"train_batch_size": 2 * args.batch, "train_micro_batch_size_per_gpu": args.batch,
              "optimizer": {"type": "SGD", "params": {"lr": 0.01}}, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 3}}
        runner, _, _, _ = deepspeed.initialize(model=model, config=ds, model_parameters=model.parameters())

        def backward_and_step(loss: Any) -> None:
            runner.backward(loss)

        def step() -> None:
            runner.step()
    generator = torch.Generator().manual_seed(dist.get_rank())
    peaks, seconds = [], []
    torch.manual_seed(1000 + dist.get_rank())
    for _ in range(args.steps):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
        dist.barrier()
        start = _step_start()
        began = time.perf_counter()
        backward_and_step(runner(input_ids=ids, labels=ids).loss)
        seconds.append(time.perf_counter() - began)
        peaks.append(_status("VmHWM") - start)
        step()
    if args.engine == "fsdp2":
        weights = [p.full_tensor().detach() for p in model.parameters()]
    else:
        parameters = list(runner.module.parameters())
        with deepspeed.zero.GatheredParameters(parameters):
            weights = [p.detach().clone() for p in parameters]
    digest = hashlib.sha256(b"".join(w.float().numpy().tobytes() for w in weights)).hexdigest()
    result: dict[str, Any] = {"rank": dist.get_rank(), "peaks": peaks, "seconds": seconds, "digest": digest}
    import acshim

    if acshim.region.ROUTERS:
        session = acshim.region.ROUTERS[0]
        result.update(plan=session.plan.describe(), budget=session.plan.budget,
                      measured=len(session._lockstep.peaks) if session._lockstep is not None else 0)
    print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    if args.engine == "zero3":
        runner.destroy()
    dist.destroy_process_group()
    from acshim.exit_settle import settle_collective_threads

    settle_collective_threads()


# ------------------------------------------------------------------------------------------ parent
def run(args: argparse.Namespace, config: str) -> dict[str, Any]:
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    budget = config.removeprefix("plan @ ") if config.startswith("plan") else None
    shim = ["-m", "acshim", "run", *(["--budget", budget] if budget else []), str(HERE)]
    shape = ["--engine", args.engine, "--layers", str(args.layers), "--width", str(args.width), "--seq", str(args.seq),
             "--batch", str(args.batch), "--vocab", str(args.vocab), "--steps", str(args.steps)]
    command = [torchrun, "--nproc-per-node", "2", "--standalone", *shim, *shape,
               "--child", "none" if config == "none" else "recompute"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1200)
    refused = [line for line in done.stderr.splitlines() if line.startswith("acshim run: --budget")]
    if done.returncode == 2 and refused:  # a budget below the least a plan reaches: said, not run
        return {"refused": refused[0]}
    if done.returncode != 0:
        raise SystemExit(f"{config}: exit {done.returncode}\n{done.stderr[-3000:]}")
    decoder = json.JSONDecoder()
    ranks = [decoder.raw_decode(chunk)[0] for chunk in done.stdout.split("RESULT ")[1:]]
    # after the explored steps and the verified ones (lockstep: two recomputed, one per storage choice,
    # the sampled one, the head's), else after the first three
    timed = slice(ranks[0].get("measured") or 3, None)
    per_step = [max(r["seconds"][i] for r in ranks) for i in range(len(ranks[0]["seconds"]))]
    return {"peak": max(max(r["peaks"][1:]) for r in ranks), "first": max(r["peaks"][0] for r in ranks),
            "seconds": statistics.median(per_step[timed]),
            "digests": {r["digest"] for r in ranks}, "plan": ranks[0].get("plan"), "budget": ranks[0].get("budget"),
            "log": [line for line in done.stderr.splitlines() if line.startswith("acshim: --budget")]}


def one_load(args: argparse.Namespace, load: str) -> None:
    configs = ["none", "full recompute", *(f"plan @ {b}" for b in args.budgets.split(","))]
    found: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    for round_ in range(args.rounds):
        order = configs[round_ % len(configs):] + configs[:round_ % len(configs)]
        for config in order:
            found[config].append(run(args, config))
    reference = found["none"]
    digests = set().union(*(r["digests"] for runs in found.values() for r in runs if "digests" in r))
    print(f"#### {load}: {'a busy-loop process on one core' if load == 'busy' else 'no other work started'}\n")
    none_peak = max(r["peak"] for r in reference)
    print(f"none: peak {none_peak / MiB:.1f} MiB (largest step after the first over ranks and rounds); weights "
          f"after {args.steps} steps bitwise equal across every configuration and round: "
          f"{'yes' if len(digests) == 1 else 'NO'}\n")
    print("| configuration | plan | peak x none | within budget | step 1 x none | step x none |")
    print("|---|---|---|---|---|---|")
    for config in configs:
        runs = found[config]
        if any("refused" in r for r in runs):
            print(f"| {config} | refused: {next(r['refused'] for r in runs if 'refused' in r)} | | | | |")
            continue
        ratio = statistics.median(r["seconds"] / ref["seconds"] for r, ref in zip(runs, reference, strict=True))
        peak, first = max(r["peak"] for r in runs), max(r["first"] for r in runs)
        plans = sorted({r["plan"] for r in runs if r["plan"]})
        within = "" if not config.startswith("plan") else (
            "yes" if all(r["peak"] <= r["budget"] for r in runs) else "NO")
        print(f"| {config} | {' / '.join(plans)} | {peak / none_peak:.2f} | {within} | {first / none_peak:.2f} "
              f"| {ratio:.2f} |")
    print()
    for config in configs:
        for line in found[config][0].get("log", []):
            print(f"    {config}: {line}")
    print()


def main(argv: list[str]) -> None:
    args = parse(argv)
    if args.child:
        child(args)
        return
    import torch
    import transformers

    print(f"### sharded: HF GPT2LMHeadModel {args.layers}x{args.width}, batch {args.batch}x{args.seq} per rank, "
          f"vocab {args.vocab}, dropout on; {args.engine}, 2 gloo ranks, one torch thread each; "
          f"torch {torch.__version__}, transformers {transformers.__version__}; {args.steps} steps, "
          f"{args.rounds} rounds\n")
    loads = ["idle", "busy"] if args.load == "both" else [args.load]
    for load in loads:
        busy = None
        if load == "busy":
            busy = subprocess.Popen([sys.executable, "-c", f"import time\nt = time.time()\n"
                                     f"while time.time() - t < {args.busy_seconds}: pass"])
        try:
            one_load(args, load)
        finally:
            if busy is not None:
                busy.kill()
                busy.wait(timeout=30)


if __name__ == "__main__":
    main(sys.argv[1:])
