"""GPU benchmark of activation offloading (issue 19): one command, one table.

For HF GPT-2 and Llama built from configs (random weights, nothing downloaded; default 12 layers x 768,
batch 8 x 1024, dropout on), per configuration: training step time (median of interleaved rounds,
order rotated each round, as docs/measuring.md asks; each model's timing in a process of its own),
peak *reserved* (``torch.cuda.max_memory_reserved()``) and peak allocated memory, and the activation
peak (``max_memory_allocated`` above what the model, its gradients and its input hold: the baseline
is taken after a warm-up step, once gradients exist) of one step measured in a fresh process each;
whether the step's gradients are bitwise equal to no checkpointing's (deterministic kernels, same
seed); and for acshim's offload the copy/compute overlap from CUDA events only: every copy is timed
by events on its stream, and every wait of the compute stream for a copy by an event pair around
the wait on the compute stream (the stall); overlap = 1 - stalls / copy time.

Configurations: no checkpointing; full recompute (``acshim.apply_checkpointing``); acshim host-tier
offload (``acshim.offload(storage="host")``) with prefetch 0, 1 and 2; torch's ``save_on_cpu``
(pinned) and ``offload_wrapper``; torchtune's ``OffloadActivations`` when torchtune is installed.

    python benchmarks/bench_gpu.py                     # both models, writes benchmarks/results/gpu.md
    python benchmarks/bench_gpu.py --models gpt2 --layers 4 --seq 512 --rounds 3

Without a GPU it prints "no GPU: skipped" and exits 0. NOT RUN YET: no GPU is available to this
project, so no figure from it appears anywhere (``benchmarks/gpu_check.sh`` runs it on one).
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

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (before CUDA starts)

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
    """The real CUDA runtime, with CUDA events around every copy (on its stream) and around every
    wait of a compute stream for a copy (on the compute stream: the stall)."""

    def __init__(self) -> None:
        from acshim.backends.runtime import TorchCudaRuntime

        self.inner = TorchCudaRuntime()
        self.copies: list[tuple[str, Any, Any]] = []
        self.stalls: list[tuple[Any, Any]] = []
        self.side: set[int] = set()
        """Ids (``cuda_stream``) of the backend's own streams: their waits are not compute stalls."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def Stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self.inner.Stream(device)
        self.side.add(stream.cuda_stream)
        return stream

    def Event(self) -> torch.cuda.Event:
        return _StallTimedEvent(self)

    def copy(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        stream = torch.cuda.current_stream()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        destination.copy_(source, non_blocking=True)
        end.record(stream)
        self.copies.append(("out" if destination.device.type == "cpu" else "in", start, end))

    def copy_ms(self) -> dict[str, float]:
        """Milliseconds of copies out, copies in and compute stalls since the last call."""
        torch.cuda.synchronize()
        total = {"out": 0.0, "in": 0.0, "stall": 0.0}
        for direction, start, end in self.copies:
            total[direction] += start.elapsed_time(end)
        for start, end in self.stalls:
            total["stall"] += start.elapsed_time(end)
        self.copies.clear()
        self.stalls.clear()
        return total


class _StallTimedEvent(torch.cuda.Event):
    """An event whose ``wait`` on a compute stream is bracketed by timing events on that stream
    (``Stream.wait_event(event)`` calls ``event.wait(stream)``)."""

    def __new__(cls, runtime: TimedRuntime) -> _StallTimedEvent:
        return super().__new__(cls)  # torch.cuda.Event takes its options in __new__

    def __init__(self, runtime: TimedRuntime) -> None:
        self.runtime = runtime

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        stream = torch.cuda.current_stream() if stream is None else stream
        if stream.cuda_stream in self.runtime.side:
            super().wait(stream)
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        super().wait(stream)
        end.record(stream)
        self.runtime.stalls.append((start, end))


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
    """One training step; gradients are zeroed in place, not freed (they exist from the first step on,
    as in training, so a baseline taken after a step includes them)."""
    model.zero_grad(set_to_none=False)
    with context():
        loss = model(**inputs).loss
    loss.backward()


def gradients(model: torch.nn.Module, inputs: dict[str, Any], context: Callable[[], Any]) -> list[torch.Tensor]:
    """The gradients of one step from a fixed seed (dropout masks repeat), deterministic kernels."""
    torch.manual_seed(1)
    step(model, inputs, context)
    return [p.grad.detach().clone() for p in model.parameters()]


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
    base = torch.cuda.memory_allocated()  # model, gradients, inputs
    torch.cuda.reset_peak_memory_stats()
    step(model, inputs, context)
    torch.cuda.synchronize()
    return {"reserved_mib": torch.cuda.max_memory_reserved() / MiB,
            "allocated_mib": torch.cuda.max_memory_allocated() / MiB,
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
    torch.use_deterministic_algorithms(True)
    expected = gradients(*prepared["none"][:2], inputs)
    exact = {config: all(torch.equal(a, b) for a, b in zip(gradients(*prepared[config][:2], inputs), expected))
             for config in configs}
    torch.use_deterministic_algorithms(False)
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
        row = {"step_ms": statistics.median(times[config]), "ratio": statistics.median(ratios),
               "exact": exact[config]}
        if copies[config]:
            copy_ms = statistics.median(c["out"] + c["in"] for c in copies[config])
            stall_ms = statistics.median(c["stall"] for c in copies[config])
            row.update(copy_ms=copy_ms, stall_ms=stall_ms,
                       overlap=1 - min(1.0, stall_ms / copy_ms) if copy_ms else 1.0)
        results[config] = row
    return results


def table(model_name: str, args: argparse.Namespace, timing: dict[str, Any], memory: dict[str, Any]) -> str:
    lines = [f"### {model_name}: {args.layers} layers x {args.width}, batch {args.batch} x {args.seq}, "
             f"{torch.cuda.get_device_name()}",
             "", "| configuration | bitwise equal | step ms | x none | peak reserved MiB | peak allocated MiB "
             "| activation peak MiB | copy ms/step | stall ms/step | overlap (events) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for config, row in timing.items():
        mem = memory.get(config, {})
        copy = f"{row['copy_ms']:.1f}" if "copy_ms" in row else ""
        stall = f"{row['stall_ms']:.1f}" if "stall_ms" in row else ""
        overlap = f"{row['overlap']:.0%}" if "overlap" in row else ""
        nan = float("nan")
        lines.append(f"| {config} | {'yes' if row['exact'] else '**no**'} | {row['step_ms']:.1f} | {row['ratio']:.2f} "
                     f"| {mem.get('reserved_mib', nan):.0f} | {mem.get('allocated_mib', nan):.0f} "
                     f"| {mem.get('activation_peak_mib', nan):.0f} | {copy} | {stall} | {overlap} |")
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
    parser.add_argument("--timing-of", metavar="MODEL", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no GPU: skipped")
        return 0
    if args.memory_of:  # child: one configuration's memory, in a fresh CUDA context
        print(json.dumps(measure_memory(args, *args.memory_of)))
        return 0
    configs = configurations()
    if args.timing_of:  # child: one model's timing and exactness, in a process of its own
        print(json.dumps(measure_time(args, args.timing_of, configs)))
        return 0
    shape = ["--layers", str(args.layers), "--width", str(args.width), "--batch", str(args.batch),
             "--seq", str(args.seq), "--rounds", str(args.rounds), "--steps", str(args.steps)]
    sections = []
    for model_name in args.models:
        memory = {}
        for config in configs:
            done = _child(["--memory-of", model_name, config, *shape])
            if done is not None:
                memory[config] = done
        timing = _child(["--timing-of", model_name, *shape])
        if timing is None:
            continue
        sections.append(table(model_name, args, timing, memory))
        print(sections[-1], flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as handle:
        handle.write("\n\n".join(sections) + "\n")
    print(f"\nwritten to {args.out}")
    return 0 if len(sections) == len(args.models) else 1


def _child(arguments: list[str]) -> Any:
    """Run this script with ``arguments`` in a fresh process; its last stdout line as JSON (None on failure)."""
    done = subprocess.run([sys.executable, os.path.abspath(__file__), *arguments], capture_output=True, text=True)
    if done.returncode != 0:
        print(f"{' '.join(arguments)}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    raise SystemExit(main())
