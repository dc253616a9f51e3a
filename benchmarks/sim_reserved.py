"""Reserved device memory and timing of the offload tier, measured on the simulated CUDA runtime
(issue 27): HF GPT-2 (random weights, dropout on), batch x sequence 8 x 512, host tier, prefetch
0/1/2.

1. The floor: the bytes the largest backward node unpacks at once (any design that reloads saved
   tensors whole must hold them together), against the issue's average-based bound.
2. Lazy order (``SimulatedCuda("lazy")``: the device a whole backward behind the host, nothing seen
   finished that the host did not wait for): peak *reserved* bytes (the caching allocator's
   per-stream pools, ``backends/simcuda.py``), the issue's bound (saved bytes x (H + 1) / saved
   groups, + 0: the host tier stages nothing on the device), the largest H + 2 consecutive groups,
   the same with reload buffers given back through ``record_stream`` (before issue 27), exactness.
3. Timed mode (``backends/simtime.py``: a virtual clock per stream, durations from a bandwidth
   model with H100 SXM figures, a pinned link of 25 GB/s (PCIe) or 450 GB/s (GH200's NVLink-C2C)):
   the host's step time and its waits in forward and backward, how far the device is behind at the
   end of forward and of backward, the device's step time, the compute stream's busy and idle time
   (and the part of it stalled on copies), copy time, copy/compute overlap, peak reserved, the peak
   of copies out in flight (device memory a GPU still holds for them)::

    python benchmarks/sim_reserved.py                   # GPT-2 3 x 64, 8 x 512 (a minute on a CPU)
    python benchmarks/sim_reserved.py --layers 2 --batch 2 --seq 128

CPU only, no GPU figure: the simulator counts the blocks the backend allocates and times work by a
model, not a GPU's memory or clocks.
"""

from __future__ import annotations

import argparse
import contextlib
import gc

import torch

MiB = 2**20


WIDTH = 64
"""Hidden size of the model (``--width``; the tiny config's 64 by default, GPT-2's own is 768)."""


def _model(layers: int, seq: int) -> torch.nn.Module:
    from acshim.testing import hf_model

    heads = 4 if WIDTH == 64 else max(1, WIDTH // 64)  # the tiny config's 4 heads, else GPT-2's heads of 64
    return hf_model("gpt2", n_layer=layers, n_positions=seq, n_embd=WIDTH, n_head=heads)


def _inputs(batch: int, seq: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(2))
    return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


LINKS = {"pcie": 25e9, "c2c": 450e9}
"""Pinned host <-> device bandwidths of the timed runs: an effective PCIe gen5 x16 link (the
``BandwidthModel`` default) and GH200's NVLink-C2C (450 GB/s per direction, NVIDIA's figure)."""


def measure(layers: int, batch: int, seq: int, prefetch: int | None, stream_ordered: bool = True,
            link: float | None = None) -> dict[str, object]:
    """One offloaded step of GPT-2 on the simulated runtime (``prefetch`` None: no offload); its
    reserved bytes and exactness, and with ``link`` (pinned bytes/s) the timed mode's figures."""
    from acshim.backends.cuda import CudaBackend
    from acshim.backends.simcuda import SimulatedCuda
    from acshim.backends.simtime import BandwidthModel
    from acshim.storage import offload
    from acshim.storage.reaper import REAPER

    model, inputs = _model(layers, seq), _inputs(batch, seq)
    torch.manual_seed(1)
    model(**inputs).loss.backward()
    expected = _grads(model)
    model.zero_grad(set_to_none=True)
    sim = SimulatedCuda("lazy", timing=BandwidthModel(pinned_bytes_per_s=link) if link else None)
    backend = CudaBackend(torch.device("cpu"), runtime=sim)
    if not stream_ordered:  # before issue 27: every reload buffer given back through record_stream
        backend._lend = lambda buffer, consumer: sim.record_stream(buffer, consumer)
    sizes: list[int] = []  # bytes of each copy out, in forward order (backward fetches them in reverse)
    copy_out = backend.copy_out
    backend.copy_out = lambda data, tier, ready=None: (sizes.append(data.numel()), copy_out(data, tier, ready))[1]
    timeline = sim.timeline
    scope = contextlib.nullcontext() if prefetch is None else offload("host", prefetch, min_bytes=1024, backend=backend)
    with sim.compute():
        torch.manual_seed(1)
        with scope:
            loss = model(**inputs).loss
        if timeline is not None:  # the forward/backward boundary: how far the device is behind
            forward = {"forward_host_s": timeline.host, "forward_wait_s": timeline.host_wait_s,
                       "forward_lag_s": max(timeline.last_end.values()) - timeline.host}
        loss.backward()
        del loss
        gc.collect()
        REAPER.settle()
        sim.check()
        if timeline is not None:  # the end of backward (before close, which waits for the side streams)
            report = timeline.report(sim.default_stream.id, [backend._d2h.id, backend._h2d.id])
    got = _grads(model)
    backend.close()
    moved = scope.stats.moved_bytes if prefetch is not None else 0
    groups = scope.stats.moved if prefetch is not None else 0
    horizon = prefetch or 0
    windows = [sum(sizes[i:i + horizon + 2]) for i in range(max(1, len(sizes) - horizon - 1))] if sizes else [0]
    row = {"prefetch": prefetch, "stream_ordered": stream_ordered, "saved_bytes": moved, "groups": groups,
           "peak_reserved": sim.peak_reserved_bytes, "peak_allocated": sim.peak_allocated_bytes,
           "peak_pending_out": sim.peak_pending_out_bytes, "issue_bound": moved * (horizon + 1) / max(1, groups),
           "window_bound": max(windows), "violations": len(sim.violations),
           "exact": len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))}
    if timeline is not None:
        row.update(forward)
        row.update(report)
        row["backward_wait_s"] = row["host_wait_s"] - row["forward_wait_s"]
    return row


def largest_node(layers: int, batch: int, seq: int, min_bytes: int = 1024) -> tuple[int, str, int, int]:
    """The floor of any design that reloads saved tensors whole: one backward node needs every tensor
    it saved on the device at once. Walks the graph of one forward (no offload) and sums, per node,
    the storages of the tensors it saved that the tier would move (``movable``). Returns the largest
    node's (bytes, name), and the bytes and count of all moved storages."""
    from acshim.storage.layout import movable

    model, inputs = _model(layers, seq), _inputs(batch, seq)
    torch.manual_seed(1)
    loss = model(**inputs).loss
    seen, stack, every = set(), [loss.grad_fn], {}
    best: tuple[int, str] = (0, "")
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        storages = {}
        for name in dir(node):
            if not name.startswith("_saved_"):
                continue
            try:
                value = getattr(node, name)
            except RuntimeError:  # a saved value already freed, or not a tensor to unpack
                continue
            for tensor in value if isinstance(value, (tuple, list)) else [value]:
                if isinstance(tensor, torch.Tensor) and movable(tensor, min_bytes):
                    storage = tensor.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
        every.update(storages)
        best = max(best, (sum(storages.values()), node.name()))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return best[0], best[1], sum(every.values()), len(every)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--width", type=int, default=64, help="hidden size (heads of 64; the tiny config: 4 of 16)")
    parser.add_argument("--links", nargs="+", default=list(LINKS), choices=list(LINKS))
    parser.add_argument("--skip-reserved", action="store_true", help="only the floor and the timed table")
    args = parser.parse_args(argv)
    global WIDTH
    WIDTH = args.width
    shape = (args.layers, args.batch, args.seq)
    print(f"HF GPT-2 (tiny config, {args.layers} layers x {args.width}), {args.batch} x {args.seq}, host tier, simulated "
          "(CPU; no GPU figure)\n")
    floor, name, total, count = largest_node(*shape)
    print(f"Floor: the largest backward node ({name}) unpacks {floor / MiB:.1f} MiB at once; {total / MiB:.1f} MiB "
          f"moved in {count} storages (average {total / max(1, count) / MiB:.2f} MiB)\n")
    if not args.skip_reserved:
        print("Lazy order (the device a whole backward behind):\n")
        print("| H | reload release | saved MiB | groups | peak allocated MiB | peak reserved MiB | issue bound MiB "
              "| H+2 window MiB | largest node MiB | violations | bitwise equal |\n|---|---|---|---|---|---|---|---|---|---|---|")
        for prefetch in (0, 1, 2):
            for ordered in (True, False):
                row = measure(*shape, prefetch, ordered)
                print(f"| {prefetch} | {'stream-ordered' if ordered else 'record_stream'} | {row['saved_bytes'] / MiB:.1f} "
                      f"| {row['groups']} | {row['peak_allocated'] / MiB:.2f} | {row['peak_reserved'] / MiB:.2f} "
                      f"| {row['issue_bound'] / MiB:.2f} | {row['window_bound'] / MiB:.2f} | {floor / MiB:.1f} "
                      f"| {row['violations']} | {row['exact']} |", flush=True)
    print("\nTimed mode (virtual clocks, BandwidthModel defaults: H100 SXM figures; pinned link as named), ms:\n")
    print("| link | H | host step | host wait fwd / bwd | device lag at fwd / bwd end | device step | compute busy "
          "| compute idle (stalled on copies) | copy busy | overlap | peak reserved MiB | peak out in flight MiB "
          "| bitwise equal |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for link_name in args.links:
        link = LINKS[link_name]
        for prefetch in (None, 0, 1, 2):
            row = measure(*shape, prefetch, True, link)
            ms = {key: value * 1e3 for key, value in row.items() if key.endswith("_s")}
            print(f"| {link_name} {link / 1e9:.0f} GB/s | {'no offload' if prefetch is None else prefetch} "
                  f"| {ms['host_s']:.2f} | {ms['forward_wait_s']:.2f} / {ms['backward_wait_s']:.2f} "
                  f"| {ms['forward_lag_s']:.2f} / {ms['device_lag_s']:.2f} | {ms['device_s']:.2f} | {ms['compute_busy_s']:.2f} "
                  f"| {ms['compute_idle_s']:.2f} ({ms['compute_stall_s']:.2f}) | {ms['copy_busy_s']:.2f} "
                  f"| {row['overlap']:.0%} | {row['peak_reserved'] / MiB:.1f} | {row['peak_pending_out'] / MiB:.1f} "
                  f"| {row['exact']} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
