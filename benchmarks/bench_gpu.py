"""GPU benchmark of activation offloading (issue 19): one command, one table.

For HF GPT-2 and Llama built from configs (random weights, nothing downloaded; default 12 layers x 768,
batch 8 x 1024, dropout on), per configuration: training step time (median of interleaved rounds,
order rotated each round, as docs/measuring.md asks), ``torch.cuda.max_memory_reserved()`` and the
activation peak (``max_memory_allocated`` above what the model, its gradients and its input hold) of
one step measured in a fresh process each, and for acshim's offload the copy/compute overlap from
CUDA events around every copy (1 - exposed copy time / total copy time, where the exposed time is
the step's time over the no-offload step's).

Configurations: no checkpointing; full recompute (``acshim.apply_checkpointing``); acshim host-tier
offload (``acshim.offload(storage="host")``) with prefetch 0, 1 and 2; torch's ``save_on_cpu``
(pinned) and ``offload_wrapper``; torchtune's ``OffloadActivations`` when torchtune is installed.

    python benchmarks/bench_gpu.py                     # both models, writes benchmarks/results/gpu.md
    python benchmarks/bench_gpu.py --models gpt2 --layers 4 --seq 512 --rounds 3

Without a GPU it prints "no GPU: skipped" and exits 0. NOT RUN YET: no GPU is available to this
project, so no figure from it appears anywhere.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

MiB = 2**20
ACSHIM_HORIZONS = (0, 1, 2)


def configurations() -> list[str]:
    names = ["none", "recompute", *(f"acshim-host-h{h}" for h in ACSHIM_HORIZONS), "torch-save_on_cpu",
             "torch-offload_wrapper"]
    try:
        import torchtune.training  # noqa: F401
    except ImportError:
        pass
    else:
        names.append("torchtune-offload")
    return names


def build(model_name: str, layers: int, width: int, seq: int) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    if model_name == "gpt2":
        config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=width // 64, n_positions=seq,
                                         vocab_size=32000, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=width, intermediate_size=4 * width,
                                          num_attention_heads=width // 64, num_key_value_heads=width // 64,
                                          vocab_size=32000, max_position_embeddings=seq, attention_dropout=0.1)
        model = transformers.LlamaForCausalLM(config)
    return model.cuda().train()


class TimedRuntime:
    """The real CUDA runtime, with a pair of timing events around every copy (the overlap figure)."""

    def __init__(self) -> None:
        from acshim.backends.runtime import TorchCudaRuntime

        self.inner = TorchCudaRuntime()
        self.copies: list[tuple[str, Any, Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def copy(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        stream = torch.cuda.current_stream()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        destination.copy_(source, non_blocking=True)
        end.record(stream)
        self.copies.append(("out" if destination.device.type == "cpu" else "in", start, end))

    def copy_ms(self) -> dict[str, float]:
        torch.cuda.synchronize()
        total = {"out": 0.0, "in": 0.0}
        for direction, start, end in self.copies:
            total[direction] += start.elapsed_time(end)
        self.copies.clear()
        return total


def prepare(config: str, model: torch.nn.Module) -> tuple[torch.nn.Module, Callable[[], Any], TimedRuntime | None]:
    """The model to step and the context its forward runs in, for ``config``."""
    import acshim

    if config == "none":
        return model, contextlib.nullcontext, None
    if config == "recompute":
        acshim.apply_checkpointing(model)
        return model, contextlib.nullcontext, None
    if config.startswith("acshim-host-h"):
        from acshim.backends.cuda import CudaBackend

        runtime = TimedRuntime()
        backend = CudaBackend(torch.device("cuda", torch.cuda.current_device()), runtime=runtime)
        horizon = int(config.rsplit("h", 1)[1])
        return model, lambda: acshim.offload(storage="host", prefetch=horizon, backend=backend), runtime
    if config == "torch-save_on_cpu":
        return model, lambda: torch.autograd.graph.save_on_cpu(pin_memory=True), None
    if config == "torch-offload_wrapper":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import offload_wrapper

        return offload_wrapper(model), contextlib.nullcontext, None
    if config == "torchtune-offload":
        from torchtune.training import OffloadActivations

        return model, lambda: OffloadActivations(use_streams=True), None
    raise ValueError(f"unknown configuration {config!r}")


def step(model: torch.nn.Module, inputs: dict[str, Any], context: Callable[[], Any]) -> None:
    with context():
        loss = model(**inputs).loss
    loss.backward()
    model.zero_grad(set_to_none=True)


def inputs_for(batch: int, seq: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 32000, (batch, seq), generator=generator).cuda()
    return {"input_ids": ids, "labels": ids, "use_cache": False}


def measure_memory(args: argparse.Namespace, model_name: str, config: str) -> dict[str, float]:
    """Run one configuration in this (fresh) process: peak reserved and activation peak, in MiB."""
    model = build(model_name, args.layers, args.width, args.seq)
    inputs = inputs_for(args.batch, args.seq)
    model, context, _ = prepare(config, model)
    step(model, inputs, context)  # warm-up: pools, kernels, gradients exist from here on
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step(model, inputs, context)
    torch.cuda.synchronize()
    return {"reserved_mib": torch.cuda.max_memory_reserved() / MiB,
            "activation_peak_mib": (torch.cuda.max_memory_allocated() - base) / MiB}


def measure_time(args: argparse.Namespace, model_name: str, configs: list[str]) -> dict[str, dict[str, float]]:
    """Interleaved step times (median over rounds of per-round ratios to "none") and overlap."""
    prepared = {}
    for config in configs:
        prepared[config] = prepare(config, build(model_name, args.layers, args.width, args.seq))
    inputs = inputs_for(args.batch, args.seq)
    for model, context, _ in prepared.values():
        for _ in range(2):
            step(model, inputs, context)
    times: dict[str, list[float]] = {config: [] for config in configs}
    copies: dict[str, list[dict[str, float]]] = {config: [] for config in configs}
    for round_index in range(args.rounds):
        order = configs[round_index % len(configs):] + configs[:round_index % len(configs)]
        for config in order:
            model, context, runtime = prepared[config]
            if runtime is not None:
                runtime.copy_ms()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.steps):
                step(model, inputs, context)
            torch.cuda.synchronize()
            times[config].append((time.perf_counter() - start) / args.steps * 1000)
            if runtime is not None:
                per_step = runtime.copy_ms()
                copies[config].append({k: v / args.steps for k, v in per_step.items()})
    results = {}
    for config in configs:
        ratios = [t / base for t, base in zip(times[config], times["none"])]
        row = {"step_ms": statistics.median(times[config]), "ratio": statistics.median(ratios)}
        if copies[config]:
            copy_ms = statistics.median(c["out"] + c["in"] for c in copies[config])
            exposed = max(0.0, row["step_ms"] - statistics.median(times["none"]))
            row.update(copy_ms=copy_ms, overlap=1 - min(1.0, exposed / copy_ms) if copy_ms else 1.0)
        results[config] = row
    return results


def table(model_name: str, args: argparse.Namespace, timing: dict[str, Any], memory: dict[str, Any]) -> str:
    lines = [f"### {model_name}: {args.layers} layers x {args.width}, batch {args.batch} x {args.seq}, "
             f"{torch.cuda.get_device_name()}",
             "", "| configuration | step ms | x none | max reserved MiB | activation peak MiB | copy ms/step | overlap |",
             "|---|---|---|---|---|---|---|"]
    for config, row in timing.items():
        mem = memory.get(config, {})
        copy = f"{row['copy_ms']:.1f}" if "copy_ms" in row else ""
        overlap = f"{row['overlap']:.0%}" if "overlap" in row else ""
        lines.append(f"| {config} | {row['step_ms']:.1f} | {row['ratio']:.2f} | {mem.get('reserved_mib', float('nan')):.0f} "
                     f"| {mem.get('activation_peak_mib', float('nan')):.0f} | {copy} | {overlap} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt2", "llama"], choices=["gpt2", "llama"])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="steps per configuration per round")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gpu.md"))
    parser.add_argument("--memory-of", nargs=2, metavar=("MODEL", "CONFIG"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no GPU: skipped")
        return 0
    if args.memory_of:  # child: one configuration's memory, in a fresh CUDA context
        print(json.dumps(measure_memory(args, *args.memory_of)))
        return 0
    configs = configurations()
    sections = []
    for model_name in args.models:
        memory = {}
        for config in configs:
            command = [sys.executable, os.path.abspath(__file__), "--memory-of", model_name, config,
                       "--layers", str(args.layers), "--width", str(args.width), "--batch", str(args.batch),
                       "--seq", str(args.seq)]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode == 0:
                memory[config] = json.loads(done.stdout.strip().splitlines()[-1])
            else:
                print(f"{model_name} {config}: memory run failed\n{done.stderr[-2000:]}", file=sys.stderr)
        timing = measure_time(args, model_name, configs)
        sections.append(table(model_name, args, timing, memory))
        print(sections[-1], flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as handle:
        handle.write("\n\n".join(sections) + "\n")
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
