"""``synchronize`` and ``profile`` of DeepSpeed checkpointing, as an engine ``RegionObserver``.

Upstream (checkpointing.py with deepspeed/utils/timer.py) synchronizes the accelerator at the start
and end of each checkpoint's forward and backward, and with ``profile`` times them on one shared
``SynchronizedWallClockTimer`` and prints ``[Rank R] time (ms) | fwd: 0.06`` /
``[Rank R] time (ms) | backward: 0.19`` after each (R is -1 when torch.distributed is not
initialised; only rank 0 prints otherwise). Same here: for ``checkpoint`` (reentrant) ``backward``
runs from the start of the recompute to the end of the region's inner backward. One difference for
``non_reentrant_checkpoint``: the engine reports no end of that region's backward (its gradients
flow through the outer graph), so there ``backward`` times the recompute, the larger part.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

FORWARD_GLOBAL_TIMER = "fwd"
BACKWARD_TIMER = "backward"


def synchronize_device() -> None:
    """Wait for the accelerator (``get_accelerator().synchronize()``); nothing to wait for on CPU."""
    accelerator = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    if accelerator is not None:
        torch.accelerator.synchronize()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else -1


class _Timer:
    """One named wall-clock timer; starts nest (a checkpoint inside a checkpoint)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._starts: list[float] = []
        self._elapsed = 0.0

    def start(self) -> None:
        synchronize_device()
        self._starts.append(time.perf_counter())

    def stop(self) -> None:
        if not self._starts:
            raise RuntimeError(f"{self.name} timer is not started")
        synchronize_device()
        self._elapsed += time.perf_counter() - self._starts.pop()

    def reset(self) -> None:
        self._elapsed = 0.0

    def elapsed(self, reset: bool = True) -> float:
        """Seconds accumulated so far (then zeroed when ``reset``)."""
        value = self._elapsed
        if reset:
            self.reset()
        return value


class Timers:
    """The module's ``timers``: ``timers(name)`` gives a timer, ``timers.log(names)`` prints them in
    upstream's format (``SynchronizedWallClockTimer``)."""

    def __init__(self) -> None:
        self.timers: dict[str, _Timer] = {}

    def __call__(self, name: str) -> _Timer:
        if name not in self.timers:
            self.timers[name] = _Timer(name)
        return self.timers[name]

    def log(self, names: list[str], normalizer: float = 1.0, reset: bool = True, memory_breakdown: bool = False,
            ranks: list[int] | None = None) -> None:
        assert normalizer > 0.0
        line = "time (ms)"
        for name in names:
            if name in self.timers:
                line += f" | {name}: {self.timers[name].elapsed(reset=reset) * 1000.0 / normalizer:.2f}"
        rank = _rank()
        if rank == -1 or rank in (ranks or [0]):
            print(f"[Rank {rank}] {line}", flush=True)


class CheckpointObserver:
    """Synchronize and/or time one checkpoint call's forward and recompute."""

    def __init__(self, synchronize: bool, timers: Timers | None, reentrant: bool = True) -> None:
        self.synchronize = synchronize
        self.timers = timers
        self.reentrant = reentrant  # reentrant regions report the end of their inner backward

    def _begin(self, name: str) -> None:
        if self.synchronize:
            synchronize_device()
        if self.timers is not None:
            self.timers(name).start()

    def _end(self, name: str) -> None:
        if self.timers is not None:
            self.timers(name).stop()
            self.timers.log([name])
        if self.synchronize:
            synchronize_device()

    def forward_start(self, region: Callable[..., Any]) -> None:
        self._begin(FORWARD_GLOBAL_TIMER)

    def forward_end(self, region: Callable[..., Any]) -> None:
        self._end(FORWARD_GLOBAL_TIMER)

    def recompute_start(self, region: Callable[..., Any]) -> None:
        self._begin(BACKWARD_TIMER)

    def recompute_end(self, region: Callable[..., Any]) -> None:
        if not self.reentrant:
            self._end(BACKWARD_TIMER)

    def backward_end(self, region: Callable[..., Any]) -> None:
        if self.reentrant:
            self._end(BACKWARD_TIMER)
