"""Virtual time for the simulated CUDA runtime (issue 27): a device that runs behind the host.

``SimulatedCuda(timing=BandwidthModel())`` gives every queued copy and every compute op a duration
from the model below and schedules it on a virtual clock per stream, the way a GPU executes its
queues: an op starts once the host has launched it, its stream's previous op has ended, and every
op its stream was made to wait for (events, ``wait_stream``) has ended. The host has a virtual clock
too: each launch costs it ``launch_s``, and a host synchronisation (``Event.synchronize``,
``Stream.synchronize``, a pageable copy) moves it to the end of what it waits for; the difference is
the host's wait. ``query`` answers by virtual time (done once the host clock has passed the end), and
so does the caching allocator for blocks given back through ``record_stream``.

What it reports (``Timeline.report``): the host's virtual wait, each stream's busy time, the compute
stream's idle time and its *stall* (time it sat ready but waiting for another stream's op: a copy in
not landed yet), and the overlap of copies with compute (time both ran / copy time): what
``benchmarks/bench_gpu.py`` measures with CUDA events on a GPU. Only the thread that built the
simulator moves the host clock (a disk-tier worker's waits are not the host's).

Defaults are public H100 SXM figures, derated to effective values; every figure is simulated, none
measured on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

Clock = dict[int, int]


@dataclass(frozen=True)
class BandwidthModel:
    """Durations of the simulated device's work, in seconds.

    Args:
        pinned_bytes_per_s: host <-> device copies from or into page-locked memory (asynchronous).
            PCIe gen5 x16 is 64 GB/s per direction on paper; 25 GB/s is an effective figure for a
            shared host link (what ``benchmarks/gpu_probe.py`` measures on a real card).
        pageable_bytes_per_s: copies from or into ordinary host memory: staged through a driver
            buffer, slower, and synchronous (the host waits for them).
        device_bytes_per_s: memory bandwidth a kernel streams at (H100 SXM HBM3: 3.35 TB/s; 80%).
        flops_per_s: arithmetic rate (H100 SXM FP32 without TF32: 67 TFLOP/s; 75%), for the ops
            ``torch.utils.flop_counter`` counts (matmuls, convolutions, attention).
        kernel_floor_s: the shortest kernel (launch latency on the device).
        copy_latency_s: fixed cost of one host <-> device copy.
        launch_s: host time to launch one op (PyTorch eager dispatch and the launch call).
    """

    pinned_bytes_per_s: float = 25e9
    pageable_bytes_per_s: float = 10e9
    device_bytes_per_s: float = 2.7e12
    flops_per_s: float = 50e12
    kernel_floor_s: float = 2e-6
    copy_latency_s: float = 2e-6
    launch_s: float = 5e-6

    def copy_seconds(self, nbytes: int, kind: str) -> float:
        """A copy of ``nbytes``; ``kind``: ``"pinned"``, ``"pageable"`` or ``"device"`` (on the GPU)."""
        if kind == "device":
            return max(self.kernel_floor_s, 2 * nbytes / self.device_bytes_per_s)
        rate = self.pinned_bytes_per_s if kind == "pinned" else self.pageable_bytes_per_s
        return self.copy_latency_s + nbytes / rate

    def kernel_seconds(self, nbytes: int, flops: float) -> float:
        """A kernel reading and writing ``nbytes`` in all and doing ``flops``."""
        return max(self.kernel_floor_s, nbytes / self.device_bytes_per_s + flops / self.flops_per_s)


def op_flops(func: object, args: tuple[object, ...], kwargs: dict[str, object], out: object) -> float:
    """FLOPs of one aten op by ``torch.utils.flop_counter``'s formulas (0 for ops it does not count)."""
    from torch.utils.flop_counter import flop_registry

    formula = flop_registry.get(getattr(func, "overloadpacket", None))
    if formula is None:
        return 0.0
    try:
        return float(formula(*args, **kwargs, out_val=out))
    except Exception:  # a formula that does not take this overload's arguments: count no FLOPs
        return 0.0


def tensor_bytes(values: list[object]) -> int:
    """Bytes of the tensors in ``values`` (each counted once per appearance)."""
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


@dataclass
class Timeline:
    """Virtual clocks: the host's, and per stream the end of each op by position."""

    model: BandwidthModel
    host: float = 0.0
    host_wait_s: float = 0.0
    waits: list[tuple[float, float, str]] = field(default_factory=list)
    """(host time, seconds waited, what) of every host wait that took time."""
    ends: dict[int, dict[int, float]] = field(default_factory=dict)
    last_end: dict[int, float] = field(default_factory=dict)
    intervals: dict[int, list[tuple[float, float]]] = field(default_factory=dict)
    stalls: dict[int, list[tuple[float, float]]] = field(default_factory=dict)
    """Per stream: (start, seconds) of each time it sat with a launched op whose dependencies on
    other streams had not ended (a compute stream waiting for a copy in)."""

    def time_of(self, clock: Clock) -> float:
        """When everything ``clock`` covers has ended (0 for nothing)."""
        latest = 0.0
        for stream, position in clock.items():
            if position > 0:
                ends = self.ends.get(stream, {})
                end = ends.get(position)
                if end is None:  # a position not scheduled (yet): its stream's latest end
                    end = self.last_end.get(stream, 0.0)
                latest = max(latest, end)
        return latest

    def schedule(self, stream: int, position: int, clock: Clock, seconds: float) -> float:
        """Op ``position`` of ``stream``, launched now, ordered after ``clock``: its end time."""
        self.host += self.model.launch_s
        others = {s: p for s, p in clock.items() if s != stream}
        ready = self.time_of(others)
        free = max(self.host, self.last_end.get(stream, 0.0))
        start = max(free, ready)
        if ready > free:
            self.stalls.setdefault(stream, []).append((free, ready - free))
        end = start + seconds
        self.ends.setdefault(stream, {})[position] = end
        self.last_end[stream] = max(end, self.last_end.get(stream, 0.0))
        self.intervals.setdefault(stream, []).append((start, end))
        return end

    def done(self, clock: Clock) -> bool:
        return self.time_of(clock) <= self.host

    def wait(self, clock: Clock, what: str) -> float:
        """The host waits for ``clock``: the seconds it waited."""
        waited = max(0.0, self.time_of(clock) - self.host)
        if waited > 0:
            self.host += waited
            self.host_wait_s += waited
            self.waits.append((self.host, waited, what))
        return waited

    def report(self, compute: int, copies: list[int], since: float = 0.0) -> dict[str, float]:
        """Figures of the work that started at or after ``since`` (seconds; a ``Timeline.host`` read
        earlier): compute stream ``compute``, copy streams ``copies``."""
        busy = _union(iv for iv in self.intervals.get(compute, []) if iv[0] >= since)
        copying = _union(iv for s in copies for iv in self.intervals.get(s, []) if iv[0] >= since)
        ends = [end for s in (compute, *copies) for start, end in self.intervals.get(s, []) if start >= since]
        device_end = max(ends, default=since)
        span = device_end - since
        compute_busy = _length(busy)
        copy_busy = _length(copying)
        both = _length(_intersect(busy, copying))
        return {"host_s": self.host - since, "device_s": span,
                "host_wait_s": sum(w for t, w, _ in self.waits if t - w >= since),
                "compute_busy_s": compute_busy, "compute_idle_s": span - compute_busy,
                "compute_stall_s": sum(w for t, w in self.stalls.get(compute, []) if t >= since),
                "copy_busy_s": copy_busy, "overlap": both / copy_busy if copy_busy else 1.0,
                "device_lag_s": device_end - self.host}


def _union(intervals: object) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):  # type: ignore[call-overload]
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out
