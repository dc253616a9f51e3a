"""GPU probe of the CUDA offload path (issue 27), a minute on one GPU; run by ``gpu_check.sh``.

- **Pinned bandwidth**: 256 MiB device <-> pinned host (``TorchCudaRuntime.pin``: registered, portable)
  each way; the host time of the ``copy_(non_blocking=True)`` call against the copy's own time (CUDA
  events): an asynchronous copy returns at once, a staged (pageable) one takes as long as the copy.
- **Exactness** (bitwise, deterministic kernels, dropout on) of host- and disk-tier offload against no
  offload: large tensors (a 4096-wide MLP, batch 4096), under bf16 autocast, after a graph dropped
  without backward and a partial backward (``autograd.grad`` of an intermediate), and on ``cuda:1``
  while ``cuda:0`` is current (when a second device exists).
- **Reserved memory** of one step (``max_memory_reserved`` after ``empty_cache``, in this process)
  under acshim host offload (prefetch 0/1/2), torch's ``save_on_cpu(pin_memory=True)``, torchtune's
  ``OffloadActivations`` (when installed) and no offload.

    python benchmarks/gpu_probe.py --out results/probe.json

Without a GPU it prints "no GPU: skipped" and exits 0. Exit status 1 if any exactness check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (before CUDA starts)

MiB = 2**20


def bandwidth(nbytes: int = 256 * MiB) -> dict[str, float]:
    """GB/s of each direction, and the host time of each ``copy_`` call against the copy's."""
    from acshim.backends.runtime import TorchCudaRuntime

    runtime = TorchCudaRuntime()
    pinned = runtime.pin(nbytes)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    results = {}
    try:
        for name, destination, source in (("d2h", pinned, device), ("h2d", device, pinned)):
            for _ in range(2):  # the first is a warm-up
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(side):
                    start.record(side)
                    called = time.perf_counter()
                    destination.copy_(source, non_blocking=True)
                    call_ms = (time.perf_counter() - called) * 1000
                    end.record(side)
                torch.cuda.synchronize()
            copy_ms = start.elapsed_time(end)
            results[f"{name}_GBps"] = nbytes / copy_ms / 1e6
            results[f"{name}_copy_ms"] = copy_ms
            results[f"{name}_call_ms"] = call_ms
    finally:
        torch.cuda.synchronize()
        runtime.unpin(pinned)
    return results


def _mlp(width: int, depth: int, device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Dropout(0.1)]
    return torch.nn.Sequential(*layers).to(device)


def _grads(model: torch.nn.Module, x: torch.Tensor, scope: Callable[[], Any] = contextlib.nullcontext,
           autocast: bool = False) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    cast = torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with cast, scope():
        loss = model(x).float().square().mean()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def exactness(directory: str) -> dict[str, bool]:
    """Bitwise equality of offloaded steps against no offload, case by case."""
    import acshim

    results = {}
    model = _mlp(4096, 4, "cuda")
    x = torch.randn(4096, 4096, device="cuda")
    for autocast in (False, True):
        expected = _grads(model, x, autocast=autocast)
        for storage in ("host", "disk"):
            for prefetch in (0, 2):
                def scope(s=storage, p=prefetch):
                    return acshim.offload(s, p, directory, min_bytes=0)
                name = f"large-{storage}-h{prefetch}{'-bf16' if autocast else ''}"
                results[name] = _equal(_grads(model, x, scope, autocast), expected)
    expected = _grads(model, x)
    for storage in ("host", "disk"):
        with acshim.offload(storage, 2, directory, min_bytes=0):  # a graph dropped without backward
            dropped = model(x).sum()
        del dropped
        with acshim.offload(storage, 2, directory, min_bytes=0):  # a partial backward, then dropped
            hidden = model[:6](x)
            out = model[6:](hidden).sum()
        torch.autograd.grad(out, hidden)
        del hidden, out
        results[f"after-dropped-and-partial-{storage}"] = _equal(
            _grads(model, x, lambda s=storage: acshim.offload(s, 2, directory, min_bytes=0)), expected)
    if torch.cuda.device_count() > 1:
        torch.cuda.set_device(0)
        second = _mlp(1024, 4, "cuda:1")
        y = torch.randn(1024, 1024, device="cuda:1")
        expected = _grads(second, y)
        for storage in ("host", "disk"):
            results[f"cuda1-{storage}"] = _equal(
                _grads(second, y, lambda s=storage: acshim.offload(s, 2, directory, min_bytes=0)), expected)
    return results


def reserved() -> dict[str, float]:
    """Peak reserved MiB of one step per configuration (same process, cache emptied between)."""
    import acshim

    model = _mlp(4096, 8, "cuda")
    x = torch.randn(8192, 4096, device="cuda")
    configs: dict[str, Callable[[], Any]] = {"none": contextlib.nullcontext}
    for prefetch in (0, 1, 2):
        configs[f"acshim-host-h{prefetch}"] = lambda p=prefetch: acshim.offload("host", p, min_bytes=1024)
    configs["torch-save_on_cpu"] = lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)
    try:
        from torchtune.training import OffloadActivations
    except ImportError:
        pass
    else:
        configs["torchtune-offload"] = lambda: OffloadActivations(use_streams=True)
    results = {}
    for name, scope in configs.items():
        _grads(model, x, scope)  # warm-up: gradients and pools exist
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        _grads(model, x, scope)
        torch.cuda.synchronize()
        results[f"{name}_reserved_MiB"] = torch.cuda.max_memory_reserved() / MiB
        results[f"{name}_allocated_MiB"] = torch.cuda.max_memory_allocated() / MiB
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the results here as JSON")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no GPU: skipped")
        return 0
    torch.use_deterministic_algorithms(True)
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "devices": torch.cuda.device_count()}
    results["bandwidth"] = bandwidth()
    with tempfile.TemporaryDirectory() as directory:
        results["exact"] = exactness(directory)
    results["reserved"] = reserved()
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as handle:
            handle.write(text + "\n")
    return 0 if all(results["exact"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
