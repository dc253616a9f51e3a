"""Live activation bytes over one step, op by op, and their high-water mark; with ``timed``, each
operator's duration too (``costs.OpTimes`` turns those into a step-time estimate).

A ``TorchDispatchMode`` keeps a handle on every storage an operator creates or touches (except
parameters, buffers and the caller's inputs) and, after each operator, drops the handles nobody else
references any more (storage reference count of one: ours). The running sum is the step's live
activation memory. Storages that are still alive at the end as parameter gradients are taken out of
the whole timeline afterwards: gradients are not activations. Exact on CPU, where the allocator
keeps no statistics (shared/MEASURING.md). Written by hand for that reason.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import structures
from ..measure import storage_key
from .pages import SMALLEST, resident_bytes, uncommitted


class LiveBytes(TorchDispatchMode):
    """Track live activation bytes; ``mark()`` records the current op index under a name.

    ``paused``: storages created meanwhile are not tracked (what a stand-in runs, see ``replay``).
    ``timed``: ``durations`` gets ``(operator key, seconds)`` per operator, and ``own_seconds`` the
    time the tracker itself took (subtracted from a wall time to get the untracked one)."""

    def __init__(self, excluded: set[int], timed: bool = False) -> None:
        super().__init__()
        self._gc_was_enabled = False
        self.excluded = excluded
        self.live: dict[int, tuple[int, torch.UntypedStorage]] = {}  # storage address -> (serial, storage)
        self.events: list[tuple[int, int, int]] = []  # (op index, serial, +bytes or -bytes)
        self.serial = 0
        self.ops = 0
        self.marks: dict[str, int] = {}
        self.reached: dict[str, int] = {}
        """Bytes noted with a mark (``profiler._mark_when_reached``: the gradient backward reached it with)."""
        self.paused = False
        self.timed = timed
        self.durations: list[tuple[Any, float]] = []
        self.own_seconds = 0.0
        self.lazy: dict[int, int] = {}  # storage address -> resident bytes counted (see pages)

    def _track(self, value: Any, lazy: bool = False) -> None:
        if self.paused:
            return
        leaves, _ = structures.flatten(value)
        for leaf in leaves:
            found = storage_key(leaf) if isinstance(leaf, torch.Tensor) else None
            if found and found[0] not in self.excluded and found[0] not in self.live:
                self.serial += 1  # addresses are reused once freed: events name storages by serial
                self.live[found[0]] = (self.serial, found[1])
                size = found[1].nbytes()
                if lazy and size >= SMALLEST:
                    size = self.lazy[found[0]] = _resident(found[1])
                self.events.append((self.ops, self.serial, size))

    def _recount(self, value: Any) -> None:
        """Count again the pages an operator wrote into the unwritten allocations it used."""
        leaves, _ = structures.flatten(value)
        for leaf in leaves:
            found = storage_key(leaf) if isinstance(leaf, torch.Tensor) else None
            if found and found[0] in self.lazy:
                now = _resident(found[1])
                if now != self.lazy[found[0]]:
                    self.events.append((self.ops, self.live[found[0]][0], now - self.lazy[found[0]]))
                    self.lazy[found[0]] = now

    def sweep(self) -> None:
        """Forget storages only this tracker still references."""
        dead = [key for key in self.live if torch._C._storage_Use_Count(key) <= 1]
        for key in dead:
            serial, storage = self.live.pop(key)
            self.events.append((self.ops, serial, -self.lazy.pop(key, storage.nbytes())))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        entered = time.perf_counter()
        self._track((args, kwargs))
        started = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        finished = time.perf_counter()
        self.ops += 1
        if self.lazy:
            self._recount((args, kwargs))
        self._track(out, lazy=uncommitted(func, args, kwargs))
        self.sweep()
        if self.timed:
            self.durations.append((op_key(func, args, kwargs), finished - started))
        self.own_seconds += (started - entered) + (time.perf_counter() - finished)
        return out

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in torch._dynamo.disable by default: importing Dynamo
        # (76 MB resident) and a wrapper call per operator (~0.25 ms). No step is compiled under this mode.
        return False

    def __enter__(self) -> LiveBytes:
        # Keep the collector off: what the step frees by reference count is freed at once, and cyclic
        # garbage is counted until the step ends (repeatable, an upper bound). No collection first: a
        # full one costs 0.1-0.3 s with a large library loaded, per measurement.
        self._gc_was_enabled = gc.isenabled()
        gc.disable()
        return super().__enter__()

    def __exit__(self, *exc_info: Any) -> None:
        super().__exit__(*exc_info)
        if self._gc_was_enabled:
            gc.enable()

    def mark(self, name: str) -> None:
        self.sweep()
        self.marks[name] = len(self.events)

    def release(self) -> None:
        self.live.clear()
        self.lazy.clear()

    def series(self, ignore: set[int]) -> list[int]:
        """Live bytes after each event, leaving out the still-live storages whose addresses are in
        ``ignore`` (call before ``release``)."""
        skipped = {self.live[key][0] for key in ignore if key in self.live}
        total, out = 0, []
        for _, serial, delta in self.events:
            if serial not in skipped:
                total += delta
            out.append(total)
        return out


def _resident(storage: torch.UntypedStorage) -> int:
    """The pages of an unwritten allocation that are resident (``pages.resident_bytes``); 0 on fake
    tensors (a meta storage has no pages: the fake step is a lower bound of no checkpointing's peak,
    ``estimate``, and TRL's 120 MiB scratch buffer, of which a step writes under 8 MiB, counted whole
    made it 2.3x the peak the process has without checkpointing)."""
    return 0 if storage.device.type == "meta" else resident_bytes(storage)


_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)


def op_key(func: Any, args: Any, kwargs: Any) -> tuple[Any, ...]:
    """What an operator's duration depends on: the operator, its tensors' shapes and dtypes, its other
    arguments (small ones; a dropout probability, a dimension)."""
    leaves, _ = structures.flatten((args, kwargs))
    return (func, *((tuple(leaf.shape), leaf.dtype) if isinstance(leaf, torch.Tensor)
                    else (leaf if isinstance(leaf, _PLAIN) else type(leaf).__name__)
                    for leaf in leaves))


def excluded_keys(module: torch.nn.Module, *extra: Any) -> set[int]:
    """Storage ids of ``module``'s parameters and buffers and of the tensors in ``extra``."""
    keys = set()
    leaves, _ = structures.flatten(extra)
    for tensor in [*module.parameters(), *module.buffers(), *leaves]:
        found = storage_key(tensor) if isinstance(tensor, torch.Tensor) else None
        if found:
            keys.add(found[0])
    return keys


def grad_keys(module: torch.nn.Module) -> set[int]:
    """Storage ids of the parameter gradients of ``module``."""
    keys = set()
    for param in module.parameters():
        if param.grad is not None and (found := storage_key(param.grad)):
            keys.add(found[0])
    return keys
