"""A sharded model's explored steps, one choice per step, as per-region held bytes, transients and times.

``lockstep`` runs whole training steps with every region under one choice (recompute; then, where
a storage tier moves something, ``offload:TIER`` and ``recompute+offload:TIER``), since a sharded
region cannot run alone. Each step records (``lockstep.StepPeak``) the process's memory above the
step's start when the first region's forward starts (``start``) and after each region's forward
(``held_after``), each phase's peak and each phase's time. From one step run as choice ``c``:

- region i holds ``held_after[i] - held_after[i-1]`` under ``c`` (the first region: less ``start``),
  what its forward left behind: recomputed, its input; offloaded, nearly nothing (the storage
  tier's resident window, ``window`` below, aside);
- its transient is its phases' peak less ``start`` and what the regions up to it hold in that step
  (the solver adds back what they hold under the plan's own choices: ``solver``'s peak formula);
- ``keep`` comes from the recomputed steps: what ``SavedCounter`` counted on top of recompute's.

Bytes are rounded up (held to ``HELD_UNIT``, transients to ``lockstep.PHASE_UNIT``), so pages of
noise do not tell identical regions apart; times are shared by identical regions (the median).
Written for acshim: torch has no per-region
memory model for sharded engines (torch.distributed.fsdp and DeepSpeed plan nothing)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

HELD_UNIT = 64 << 10
"""A region's held bytes are rounded up to this (pages of noise between identical regions)."""


def rounded(size: int, unit: int) -> int:
    return -(-max(0, size) // unit) * unit


@dataclass
class ChoiceSteps:
    """What the explored steps run as one choice measured: the largest phase peaks over those steps,
    the least seconds, and what the regions held (``held_after``, ``start``) as the latest step
    left it: a process's first steps grow once (the storage tier's buffers and files, the engine's
    own), which a later step does not repeat (FSDP2 run first as recompute+offload: the first two
    regions 3 MiB more on the first step than on the second), and held bytes add up over regions."""

    phases: dict[str | int, int] = field(default_factory=dict)
    held_after: dict[int, int] = field(default_factory=dict)
    start: int = 0
    seconds: dict[str | int, float] = field(default_factory=dict)

    def add(self, phases: dict[str | int, int], held_after: dict[int, int], start: int | None,
            seconds: dict[str | int, float]) -> None:
        for phase, size in phases.items():
            self.phases[phase] = max(self.phases.get(phase, 0), size)
        self.held_after = dict(held_after)
        self.start = start or 0
        for phase, spent in seconds.items():
            self.seconds[phase] = min(self.seconds.get(phase, spent), spent)

    def held(self, count: int) -> list[int]:
        """Per region, what its forward left behind (never below 0)."""
        out, before = [], self.start
        for index in range(count):
            after = self.held_after.get(index, before)
            out.append(max(0, after - before))
            before = after
        return out

    def transients(self, count: int, held: list[int], peak: int, unit: int) -> list[int]:
        """Per region, its phases' peak above the step's start and the held bytes up to it."""
        out, prefix = [], 0
        for index in range(count):
            prefix += held[index]
            top = max(self.phases.get(f"forward:{index}", peak), self.phases.get(index, peak))
            out.append(rounded(top - self.start - prefix, unit))
        return out

    def region_seconds(self, index: int) -> float:
        """Region ``index``'s forward and (recompute and) backward, as timed in its phases."""
        return self.seconds.get(f"forward:{index}", 0.0) + self.seconds.get(index, 0.0)

    def outside(self, count: int, held: list[int], peak: int) -> int:
        """The part outside the regions' transient above the regions' held bytes: the forward before
        the first region, and after the regions (head, loss, the head's backward)."""
        stem = self.phases.get("stem", 0) - self.start
        rest = max(self.phases.get("forward", peak), self.phases.get("head", peak)) - self.start - sum(held)
        return max(0, stem, rest)


def median_per_key(values: list[float], keys: list[Any]) -> list[float]:
    """Each value replaced by the median among the regions with its key."""
    import statistics

    groups: dict[Any, list[float]] = {}
    for value, key in zip(values, keys, strict=True):
        groups.setdefault(key, []).append(value)
    return [statistics.median(groups[key]) for key in keys]
