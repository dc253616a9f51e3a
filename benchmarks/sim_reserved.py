"""Reserved device memory of the offload tier's reload buffers, measured on the simulated CUDA runtime
(issue 27): HF GPT-2 (random weights, dropout on), batch x sequence 8 x 512, host tier, prefetch
0/1/2, with the device running a whole backward behind the host (``SimulatedCuda("lazy")``: nothing
is seen finished that the host did not wait for, and backward never waits).

For each horizon H it reports the tier's simulated peak *reserved* bytes (the caching allocator's
per-stream pools, ``backends/simcuda.py``), the bound the issue sets (saved bytes x (H + 1) / saved
groups, + 0: the host tier stages nothing on the device), the tighter bound for groups of unequal
size (the largest H + 2 consecutive groups: H prefetched, the one in use, the one just released),
the same figure with the reload buffers given back through ``record_stream`` (the design before
issue 27), and whether the gradients are bitwise equal to no offload's::

    python benchmarks/sim_reserved.py                   # GPT-2 3 x 64, 8 x 512 (a minute on a CPU)
    python benchmarks/sim_reserved.py --layers 2 --batch 2 --seq 128

CPU only, no GPU figure: the simulator counts the blocks the backend allocates, not a GPU's memory.
"""

from __future__ import annotations

import argparse
import gc

import torch

MiB = 2**20


def _model(layers: int, seq: int) -> torch.nn.Module:
    from acshim.testing import hf_model

    return hf_model("gpt2", n_layer=layers, n_positions=seq)


def _inputs(batch: int, seq: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(2))
    return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def measure(layers: int, batch: int, seq: int, prefetch: int, stream_ordered: bool = True) -> dict[str, object]:
    """One offloaded step of GPT-2 on the simulated runtime; its reserved bytes and exactness."""
    from acshim.backends.cuda import CudaBackend
    from acshim.backends.simcuda import SimulatedCuda
    from acshim.storage import offload
    from acshim.storage.reaper import REAPER

    model, inputs = _model(layers, seq), _inputs(batch, seq)
    torch.manual_seed(1)
    model(**inputs).loss.backward()
    expected = _grads(model)
    model.zero_grad(set_to_none=True)
    sim = SimulatedCuda("lazy")
    backend = CudaBackend(torch.device("cpu"), runtime=sim)
    if not stream_ordered:  # before issue 27: every reload buffer given back through record_stream
        backend._lend = lambda buffer, consumer: sim.record_stream(buffer, consumer)
    sizes: list[int] = []  # bytes of each copy out, in forward order (backward fetches them in reverse)
    copy_out = backend.copy_out
    backend.copy_out = lambda data, tier, ready=None: (sizes.append(data.numel()), copy_out(data, tier, ready))[1]
    with sim.compute():
        torch.manual_seed(1)
        with offload("host", prefetch, min_bytes=1024, backend=backend) as scope:
            loss = model(**inputs).loss
        loss.backward()
        del loss
        gc.collect()
        REAPER.settle()
        sim.check()
    got = _grads(model)
    backend.close()
    stats = scope.stats
    windows = [sum(sizes[i:i + prefetch + 2]) for i in range(max(1, len(sizes) - prefetch - 1))] if sizes else [0]
    return {"prefetch": prefetch, "stream_ordered": stream_ordered, "saved_bytes": stats.moved_bytes,
            "groups": stats.moved, "peak_reserved": sim.peak_reserved_bytes, "peak_allocated": sim.peak_allocated_bytes,
            "issue_bound": stats.moved_bytes * (prefetch + 1) / max(1, stats.moved),
            "window_bound": max(windows), "violations": len(sim.violations),
            "exact": len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    args = parser.parse_args(argv)
    print(f"HF GPT-2 (tiny config, {args.layers} layers x 64), {args.batch} x {args.seq}, host tier, simulated "
          "device a whole backward behind\n")
    print("| H | reload release | saved MiB | groups | peak allocated MiB | peak reserved MiB | issue bound MiB | H+2 window MiB "
          "| violations | bitwise equal |\n|---|---|---|---|---|---|---|---|---|---|---|")
    for prefetch in (0, 1, 2):
        for ordered in (True, False):
            row = measure(args.layers, args.batch, args.seq, prefetch, ordered)
            print(f"| {prefetch} | {'stream-ordered' if ordered else 'record_stream'} | {row['saved_bytes'] / MiB:.1f} "
                  f"| {row['groups']} | {row['peak_allocated'] / MiB:.2f} | {row['peak_reserved'] / MiB:.2f} | {row['issue_bound'] / MiB:.2f} "
                  f"| {row['window_bound'] / MiB:.2f} | {row['violations']} | {row['exact']} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
