"""The callable a non-reentrant region hands to ``torch.utils.checkpoint``, and the region counts.

``RegionCall`` wraps the user's function: its first call is the region's forward, later calls are
recomputes. It adds what torch's checkpoint lacks: tracker RNG streams restored, state the forward
changed kept as the forward saw it (``acshim.region_buffers``), reads checked
(``acshim.region_reads``), ``is_checkpointing()`` / ``is_recomputing()`` set, observer events.

A leaf below ``acshim.region`` and ``acshim.compiled``: both use it (the eager region, and a traced
region Dynamo gave up on), neither is imported here. ``REGION_STATE`` is the one process-wide state
of the region entry point: the counts (``STATS``) and the router stack (``ROUTERS``), re-exported
under those names by ``acshim.region``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from . import region_buffers, region_reads, rng
from .options import RegionOptions
from .region_modules import region_modules
from .state import enable_checkpointing, enable_recomputing, state, temporarily


@dataclass
class RegionStats:
    """Process-wide counts of region forwards and recomputes: evidence that a script really ran
    on the engine (``acshim run`` prints them at exit when ``ACSHIM_REPORT_REGIONS=1``)."""

    forwards: int = 0
    recomputes: int = 0
    recorder: Any = None
    """``acshim run --report``'s per-region recorder (``acshim.report``): ``call`` at each region
    call, ``forward`` / ``recompute`` as the engine runs them."""

    def forward(self, function: Callable[..., Any]) -> None:
        self.forwards += 1
        if self.recorder is not None:
            self.recorder.forward(function)

    def recompute(self, function: Callable[..., Any]) -> None:
        self.recomputes += 1
        if self.recorder is not None:
            self.recorder.recompute(function)

    def __str__(self) -> str:
        return f"acshim: {self.forwards} region forwards, {self.recomputes} recomputes"


@dataclass
class RegionState:
    """What every region call consults, process-wide: one object, so tests (and tools) reset it in
    one place. The list and the stats object are kept, never replaced: ``acshim.region.ROUTERS`` /
    ``STATS`` are these very objects.

    ``acshim.uninstall()`` leaves it alone: ``install()`` puts nothing here. A router is a plan
    session its owner starts and stops (``acshim.plan`` and ``PlanSession`` work without
    ``install()``), and the counts are what ``acshim run`` prints at exit."""

    stats: RegionStats = field(default_factory=RegionStats)
    routers: list[Any] = field(default_factory=list)
    """At most one router (``acshim run --budget``'s plan session, ``acshim.planner.session``):
    every region call goes to ``router.route(function, args, kwargs, options)``, which decides how
    the region runs (keep, selective, recompute, offload) and calls
    ``acshim.region.run_region_now`` for the engine's part."""

    def reset(self) -> None:
        """Counts to zero, no recorder, no router (in place: aliases see the change)."""
        self.stats.forwards = self.stats.recomputes = 0
        self.stats.recorder = None
        self.routers.clear()


REGION_STATE = RegionState()


def notify(observer: Any, event: str, region: Callable[..., Any]) -> None:
    """Call ``observer.<event>(region)`` when the observer has that method (a lifecycle observer
    may implement only some events)."""
    if observer is not None:
        callback = getattr(observer, event, None)
        if callback is not None:
            callback(region)


class RegionCall:
    """The callable handed to torch's checkpoint: first call is the forward, later ones recompute."""

    def __init__(self, function: Callable[..., Any], options: RegionOptions) -> None:
        self.function = function
        self.options = options
        self.calls = 0
        self.tracker_states = rng.capture_tracker_states() if options.preserve_rng_state else []

        self.buffer_changes: list[region_buffers.Change] | None = None
        self.reads: region_reads.Reads | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        observer = self.options.observer
        stats = REGION_STATE.stats
        if self.calls == 1:
            stats.forward(self.function)
            notify(observer, "forward_start", self.function)
            referenced: dict[int, torch.Tensor] = {}
            modules = region_modules(self.function, args, kwargs, referenced)
            with region_buffers.watching(modules) as buffers, enable_checkpointing():
                output = self.function(*args, **kwargs)
            self.buffer_changes = buffers.changes()
            self.reads = region_reads.record(modules or buffers.modules(), self.buffer_changes,
                                             referenced.values())
            notify(observer, "forward_end", self.function)
            return output
        region_reads.check(self.reads)
        with contextlib.ExitStack() as stack:
            if self.tracker_states:
                stack.enter_context(rng.restored_tracker_states(self.tracker_states))
            stack.enter_context(temporarily(state, "is_checkpointing", False))
            stack.enter_context(enable_recomputing())
            stack.enter_context(region_buffers.as_the_forward_saw_them(self.buffer_changes))
            stats.recompute(self.function)
            notify(observer, "recompute_start", self.function)
            # torch stops an early-stopped recompute with an exception: report the end regardless
            stack.callback(notify, observer, "recompute_end", self.function)
            return self.function(*args, **kwargs)
