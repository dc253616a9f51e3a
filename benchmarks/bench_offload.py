"""Benchmark of the storage tiers (issue 5): disk-tier memory and time, prefetch overlap.

1. Disk tier on a GPT-2-shaped model (default 8 layers x 512, batch 2 x 256, dropout on; the
   activations saved for backward are ~340 MB): peak RSS of one training step, each configuration in
   a fresh subprocess (docs/measuring.md: MALLOC_MMAP_THRESHOLD_=65536, malloc_trim, clear_refs,
   VmHWM), for in-memory vs ``acshim.offload(storage="disk")``; gradients compared bitwise.
2. Step time: in-memory, disk with prefetch, disk without prefetch, interleaved in one process with
   the order rotated each round; medians of per-round ratios.
3. Prefetch overlap with the simulated-transfer backend (sleeps per byte): the transfer time that
   backward waits for with H = 0, and the share of it that H = 1 and H = 2 hide.

    python benchmarks/bench_offload.py            # full size (~2-3 min on 2 cores)
    python benchmarks/bench_offload.py --small    # the size tests use
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import memory_probe

MiB = 2**20
FULL = dict(n_layer=8, n_embd=512, seq=256)
SMALL = dict(n_layer=4, n_embd=256, seq=256)


def _model_and_inputs(n_layer: int, n_embd: int, seq: int) -> tuple[torch.nn.Module, dict[str, Any]]:
    from acshim.testing import hf_inputs, hf_model

    model = hf_model("gpt2", n_layer=n_layer, n_embd=n_embd, n_head=8, n_positions=seq)
    inputs = hf_inputs("gpt2", batch=2, seq=seq)
    inputs["use_cache"] = False
    return model, inputs


def _step(model: torch.nn.Module, inputs: dict[str, Any], storage: str | None, prefetch: int,
          native: bool | None = None) -> torch.Tensor:
    """Forward (under offload if ``storage``) with a fixed seed; returns the loss."""
    import acshim

    torch.manual_seed(1)
    if storage is None:
        return model(**inputs).loss
    with acshim.offload(storage=storage, prefetch=prefetch, native=native):
        return model(**inputs).loss


def probe_builder(argv: list[str]) -> tuple[torch.nn.Module, Any]:
    """For ``memory_probe``: argv = [n_layer, n_embd, seq, storage|none, prefetch]."""
    torch.set_num_threads(1)
    n_layer, n_embd, seq = (int(a) for a in argv[:3])
    storage = None if argv[3] == "none" else argv[3]
    model, inputs = _model_and_inputs(n_layer, n_embd, seq)
    return model, lambda: _step(model, inputs, storage, int(argv[4]))


def measure_rss(size: dict[str, int], prefetch: int = 2) -> dict[str, dict[str, int]]:
    """Peak and held RSS of one step, in-memory vs disk tier, each in a fresh subprocess."""
    args = [str(size["n_layer"]), str(size["n_embd"]), str(size["seq"])]
    return {name: memory_probe.probe(os.path.abspath(__file__), "probe_builder", args + [name, str(prefetch)])
            for name in ("none", "disk")}


def grads_equal(size: dict[str, int], prefetch: int) -> bool:
    """Disk tier (both I/O paths) gives gradients bitwise equal to the in-memory step."""
    model, inputs = _model_and_inputs(**size)
    results = []
    for storage, native in ((None, None), ("disk", True), ("disk", False)):
        model.zero_grad(set_to_none=True)
        _step(model, inputs, storage, prefetch, native).backward()
        results.append([p.grad.clone() for p in model.parameters()])
    return all(torch.equal(a, b) for other in results[1:] for a, b in zip(results[0], other))


def time_ratios(size: dict[str, int], rounds: int, prefetch: int) -> dict[str, float]:
    """Median per-round step-time ratios: disk/in-memory and disk prefetch/no-prefetch."""
    torch.set_num_threads(1)
    model, inputs = _model_and_inputs(**size)
    configs = {"memory": (None, 0), "disk_prefetch": ("disk", prefetch), "disk_no_prefetch": ("disk", 0)}

    def timed(config: tuple[str | None, int]) -> float:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        _step(model, inputs, *config).backward()
        return time.perf_counter() - start

    for config in configs.values():
        timed(config)  # warm-up
    names = list(configs)
    disk_vs_memory, prefetch_vs_none = [], []
    for round_index in range(rounds):
        order = names[round_index % 3:] + names[:round_index % 3]
        seconds = {name: timed(configs[name]) for name in order}
        disk_vs_memory.append(seconds["disk_prefetch"] / seconds["memory"])
        prefetch_vs_none.append(seconds["disk_prefetch"] / seconds["disk_no_prefetch"])
    return {"disk_vs_memory": statistics.median(disk_vs_memory),
            "prefetch_vs_no_prefetch": statistics.median(prefetch_vs_none)}


def simulated_overlap(layers: int = 12, width: int = 256, bytes_per_second: float = 2e9) -> dict[str, float]:
    """Seconds backward waits for copies in, per horizon, with a simulated link of ``bytes_per_second``."""
    import acshim
    from acshim.backends import SimulatedBackend
    from acshim.testing import tiny_sequential

    torch.manual_seed(0)
    x = torch.randn(512, width)
    exposed = {}
    for horizon in (0, 1, 2):
        model = tiny_sequential(layers, width)
        backend = SimulatedBackend(seconds_per_byte=1 / bytes_per_second)
        scope = acshim.storage.boundary_offload(storage="host", prefetch=horizon, min_bytes=0, backend=backend)
        acshim.apply_checkpointing(model, saved_tensors_scope=scope)
        model(x).sum().backward()
        exposed[horizon] = scope.stats.wait_seconds
        backend.close()
    return {"exposed_h0": exposed[0], "hidden_h1": 1 - exposed[1] / exposed[0], "hidden_h2": 1 - exposed[2] / exposed[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="the smaller model the tests use")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prefetch", type=int, default=2)
    args = parser.parse_args()
    size = SMALL if args.small else FULL

    from acshim.storage import native

    print(f"model: GPT-2 {size['n_layer']} x {size['n_embd']}, batch 2 x {size['seq']}, dropout on; "
          f"{native.status()}")
    rss = measure_rss(size, args.prefetch)
    activations = rss["none"]["held_bytes"]
    drop = rss["none"]["peak_bytes"] - rss["disk"]["peak_bytes"]
    print(f"activations held after forward (in memory): {activations / MiB:.1f} MiB")
    for name, figures in rss.items():
        print(f"  {name:>5}: held {figures['held_bytes'] / MiB:8.1f} MiB   peak {figures['peak_bytes'] / MiB:8.1f} MiB")
    print(f"peak RSS drop with the disk tier: {drop / MiB:.1f} MiB = {drop / activations:.0%} of the activations")
    print(f"gradients bitwise equal (native and Python I/O): {grads_equal(size, args.prefetch)}")
    ratios = time_ratios(size, args.rounds, args.prefetch)
    print(f"step time, disk (prefetch={args.prefetch}) / in memory: {ratios['disk_vs_memory']:.2f}")
    print(f"step time, disk prefetch={args.prefetch} / prefetch=0: {ratios['prefetch_vs_no_prefetch']:.2f}")
    overlap = simulated_overlap()
    print(f"simulated 2 GB/s link, boundary offload of 12 regions: backward waits {overlap['exposed_h0'] * 1e3:.1f} ms "
          f"with H=0; H=1 hides {overlap['hidden_h1']:.0%}, H=2 hides {overlap['hidden_h2']:.0%}")


if __name__ == "__main__":
    main()
