"""Exact choice per block: least predicted step time whose predicted peak fits the budget.

The peak is bounded from the block-by-block profile: while block i runs (its forward, or its
recompute and backward) the blocks before it still hold what they saved and the blocks after it
(already through backward) hold nothing, so
    peak = other_held + max( sum_j held_j + other_transient,  max_i (sum_{j<=i} held_j + transient_i) )
with ``transient_i`` the block's own high-water mark above its held bytes (incoming gradient and
recompute included) and ``other_*`` everything outside the blocks (embeddings, head, loss). That is
at most held-after-forward plus the largest transient (the simpler bound), and tighter. Offloaded
blocks share one schedule (``choices.SharedOffload``): its resident window (the last offloaded
block's last tensors, or an earlier one's prefetched ahead) is added to the transient of every
block that is not offloaded after the first offloaded one, and to the outside transient when any
block is offloaded (an offloaded block's own transient was measured among offloaded blocks).

The part outside the blocks has choices too: ``keep``, or its saved tensors offloaded through the
same shared schedule (``Profile.outside``, measured with the blocks recomputed). Offloaded, its
embeddings' tensors come before every block, so the window is resident during every block that is
not offloaded. The solver runs once per outside choice and keeps the fastest.

The max is handled exactly by dynamic programming over blocks x prefix held bytes x "an offloaded
block came before": choosing block i's option is allowed only if prefix + held + transient (+ the
window) fits, and the final prefix must leave room for the outside transient. Bytes are counted in units fixed by the profile (not by the budget) and
rounded up, so a larger budget only ever adds feasible plans: the optimum's time never increases,
and the prediction errs towards more memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .budget import format_bytes
from .choices import is_offload
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
    outside: str = "keep"


class BudgetTooSmall(ValueError):
    """The budget is below the least peak any combination of choices reaches."""

    def __init__(self, budget: int, minimum: int) -> None:
        super().__init__(f"budget {format_bytes(budget)} ({budget} bytes) is below the least achievable peak "
                         f"activation memory, {format_bytes(minimum)} ({minimum} bytes), with these choices")
        self.budget, self.minimum = budget, minimum


def unit_of(profile: Profile) -> int:
    """Bytes per unit of the memory axis for ``profile``."""
    most = sum(max(b.held.values()) for b in profile.blocks) + max(
        max(b.transient.values()) for b in profile.blocks) + profile.window()
    return max(1, math.ceil(most / UNITS))


def _up(size: int, unit: int) -> int:
    return -(-size // unit)


def rounded_peak(profile: Profile, assignment: list[str], outside: str = "keep") -> int:
    """The predicted peak of ``assignment`` as the solver counts it (block bytes rounded up)."""
    unit = unit_of(profile)
    other_held, other_transient, _ = profile.other(outside)
    window, seen, first = _up(profile.window(), unit) * unit, False, is_offload(outside)
    prefix, worst = 0, 0
    for block, choice in zip(profile.blocks, assignment, strict=True):
        prefix += _up(block.held[choice], unit) * unit
        worst = max(worst, prefix + _up(block.transient[choice], unit) * unit
                    + (window if (seen or first) and not is_offload(choice) else 0))
        seen = seen or is_offload(choice)
    return other_held + max(worst, prefix + other_transient + (window if seen else 0))


def minimum_peak(profile: Profile) -> int:
    """The least predicted peak over all assignments (bisection on the solver's feasibility)."""
    least = [min(profile.choices, key=lambda c, b=b: (b.held[c], b.transient[c])) for b in profile.blocks]
    low = min(sum(profile.other(o)[:2]) for o in profile.outside_choices())
    high = max(min(rounded_peak(profile, least, o) for o in profile.outside_choices()), low)
    while low < high:
        middle = (low + high) // 2
        if all(_search(profile, middle, o) is None for o in profile.outside_choices()):
            low = middle + 1
        else:
            high = middle
    return low


def _search(profile: Profile, budget: int, outside: str = "keep") -> list[int] | None:
    unit = unit_of(profile)
    other_held, other_transient, _ = profile.other(outside)
    first = is_offload(outside)
    room = budget - other_held
    if room < other_transient:
        return None
    window = _up(profile.window(), unit)
    size = room // unit
    final = [(room - other_transient) // unit, (room - other_transient) // unit - window]
    held = np.array([[_up(b.held[c], unit) for c in profile.choices] for b in profile.blocks], dtype=np.int64)
    transient = np.array([[_up(b.transient[c], unit) for c in profile.choices] for b in profile.blocks],
                         dtype=np.int64)
    seconds = np.array([[b.seconds[c] for c in profile.choices] for b in profile.blocks])
    offloads = [is_offload(c) for c in profile.choices]
    most = int(held.max(axis=1).sum())
    size = min(size, most + int(transient.max()) + window)
    # dp[seen, prefix]: least seconds so far; seen = an offloaded block came before
    dp = np.full((2, size + 1), np.inf)
    dp[0, 0] = 0.0
    picks = []
    for block in range(held.shape[0]):
        new = np.full((2, size + 1), np.inf)
        arg = np.full((2, size + 1, 2), -1, dtype=np.int64)  # (choice, seen before) per state
        for choice in range(held.shape[1]):
            weight = int(held[block, choice])
            for seen in (0, 1):
                extra = int(transient[block, choice]) + (window if (seen or first) and not offloads[choice] else 0)
                limit = size - weight - extra  # largest prefix before this block that still fits
                if limit < 0:
                    continue
                after = 1 if (seen or offloads[choice]) else 0
                candidate = np.full(size + 1, np.inf)
                candidate[weight:weight + limit + 1] = dp[seen, :limit + 1] + seconds[block, choice]
                better = candidate < new[after]
                new[after, better] = candidate[better]
                arg[after, better] = (choice, seen)
        dp = new
        picks.append(arg)
    best, state = np.inf, None
    for seen in (0, 1):
        end = min(final[seen], size)
        if end < 0 or not np.isfinite(dp[seen, :end + 1]).any():
            continue
        prefix = int(np.argmin(dp[seen, :end + 1]))
        if dp[seen, prefix] < best:
            best, state = dp[seen, prefix], (seen, prefix)
    if state is None:
        return None
    seen, prefix = state
    chosen = []
    for block in reversed(range(held.shape[0])):
        choice, before = (int(v) for v in picks[block][seen, prefix])
        chosen.append(choice)
        prefix -= int(held[block, choice])
        seen = before
    return chosen[::-1]


def solve(profile: Profile, budget: int) -> Solution:
    """The fastest assignment (blocks and the part outside them) whose predicted peak is at most
    ``budget`` bytes (``BudgetTooSmall`` naming the least achievable peak otherwise). On equal
    time the outside part is kept (it is listed first)."""
    best: Solution | None = None
    for outside in profile.outside_choices():
        picked = _search(profile, budget, outside)
        if picked is None:
            continue
        names = [profile.choices[i] for i in picked]
        found = Solution(names, profile.held_of(names, outside), rounded_peak(profile, names, outside),
                         profile.seconds_of(names, outside), outside)
        if best is None or found.seconds < best.seconds:
            best = found
    if best is None:
        raise BudgetTooSmall(budget, minimum_peak(profile))
    return best
