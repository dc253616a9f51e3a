"""Exact choice per block: least predicted step time whose predicted peak fits the budget.

Peak = bytes held when forward ends (outside the blocks plus each block's held bytes) + the largest
transient (outside the blocks, or any block's recompute/backward). The max is handled exactly by
enumerating its value: for each candidate transient cap T, only choices with transient <= T are
allowed and the held bytes must fit in budget - other - T; a 0/1 knapsack by dynamic programming over
blocks x held bytes (in units fixed by the profile, not by the budget, so a larger budget only ever
adds feasible plans and the optimum's time never increases). Held bytes are rounded up to the unit:
the prediction errs towards more memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .budget import format_bytes
from .profile import Profile

UNITS = 4096
"""Resolution of the held-bytes axis: the largest possible held total spans this many units."""


@dataclass
class Solution:
    """One solved assignment with its predictions."""

    choices: list[str]
    held: int
    peak: int
    seconds: float


class BudgetTooSmall(ValueError):
    """The budget is below the least peak any combination of choices reaches."""

    def __init__(self, budget: int, minimum: int) -> None:
        super().__init__(f"budget {format_bytes(budget)} ({budget} bytes) is below the least achievable peak "
                         f"activation memory, {format_bytes(minimum)} ({minimum} bytes), with these choices")
        self.budget, self.minimum = budget, minimum


def unit_of(profile: Profile) -> int:
    """Bytes per unit of the held axis for ``profile``."""
    most = sum(max(b.held.values()) for b in profile.blocks)
    return max(1, math.ceil(most / UNITS))


def minimum_peak(profile: Profile) -> int:
    """The least predicted peak over all assignments (held rounded up as the solver counts it)."""
    unit = unit_of(profile)
    best = None
    for cap in _caps(profile):
        total = 0
        for block in profile.blocks:
            allowed = [math.ceil(block.held[c] / unit) for c in profile.choices if block.transient[c] <= cap]
            if not allowed:
                break
            total += min(allowed)
        else:
            peak = profile.other_held + total * unit + cap
            best = peak if best is None else min(best, peak)
    assert best is not None
    return best


def rounded_peak(profile: Profile, assignment: list[str]) -> int:
    """The predicted peak of ``assignment`` as the solver counts it (held bytes rounded up)."""
    unit = unit_of(profile)
    held = sum(math.ceil(b.held[c] / unit) * unit for b, c in zip(profile.blocks, assignment, strict=True))
    return profile.peak_of(assignment) - profile.held_of(assignment) + profile.other_held + held


def _caps(profile: Profile) -> list[int]:
    values = {profile.other_transient}
    values.update(t for b in profile.blocks for t in b.transient.values() if t >= profile.other_transient)
    return sorted(values)


def solve(profile: Profile, budget: int) -> Solution:
    """The fastest assignment whose predicted peak is at most ``budget`` bytes (``BudgetTooSmall``
    naming the least achievable peak otherwise)."""
    unit = unit_of(profile)
    choices = profile.choices
    weights = np.array([[math.ceil(b.held[c] / unit) for c in choices] for b in profile.blocks], dtype=np.int64)
    seconds = np.array([[b.seconds[c] for c in choices] for b in profile.blocks])
    transients = np.array([[b.transient[c] for c in choices] for b in profile.blocks], dtype=np.int64)
    most = int(weights.max(axis=1).sum())
    best: tuple[float, int, list[int]] | None = None
    for cap in _caps(profile):
        room = budget - profile.other_held - cap
        if room < 0:
            break
        size = min(room // unit, most)
        picked = _knapsack(weights, seconds, transients <= cap, size)
        if picked is None:
            continue
        time = float(seconds[np.arange(len(picked)), picked].sum())
        peak = profile.other_held + int(weights[np.arange(len(picked)), picked].sum()) * unit + cap
        if best is None or (time, peak) < (best[0], best[1]):
            best = (time, peak, picked)
    if best is None:
        raise BudgetTooSmall(budget, minimum_peak(profile))
    names = [choices[i] for i in best[2]]
    return Solution(names, profile.held_of(names), profile.peak_of(names), profile.seconds_of(names))


def _knapsack(weights: np.ndarray, seconds: np.ndarray, allowed: np.ndarray, size: int) -> list[int] | None:
    """Least total seconds picking one choice per block with total weight <= size."""
    dp = np.zeros(size + 1)
    picks = []
    for block in range(weights.shape[0]):
        new = np.full(size + 1, np.inf)
        arg = np.full(size + 1, -1, dtype=np.int64)
        for choice in np.flatnonzero(allowed[block]):
            weight = int(weights[block, choice])
            if weight > size:
                continue
            candidate = np.full(size + 1, np.inf)
            candidate[weight:] = dp[:size + 1 - weight] + seconds[block, choice]
            better = candidate < new
            new[better], arg[better] = candidate[better], choice
        dp = new
        picks.append(arg)
    if not np.isfinite(dp[size]):
        return None
    chosen, room = [], size
    for block in reversed(range(weights.shape[0])):
        choice = int(picks[block][room])
        chosen.append(choice)
        room -= int(weights[block, choice])
    return chosen[::-1]
