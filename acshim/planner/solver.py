"""Exact choice per block: least predicted step time whose predicted peak fits the budget.

The peak is bounded from the block-by-block profile: while block i runs (its forward, or its
recompute and backward) the blocks before it still hold what they saved and the blocks after it
(already through backward) hold nothing, so
    peak = max( other_held + sum_j held_j + other_transient,  other_back + max_i (sum_{j<=i} held_j + transient_i) )
with ``transient_i`` the block's own high-water mark above its held bytes (incoming gradient and
recompute included), ``other_*`` everything outside the blocks (embeddings, head, loss) and
``other_back`` what of it is held while the blocks run (``Profile.back``: the head's saved tensors
are made after the blocks' forward and freed before their backward). That is at most
held-after-forward plus the largest transient (the simpler bound), and tighter. Offloaded
blocks share one schedule (``choices.SharedOffload``): its resident window (the last offloaded
block's last tensors, or an earlier one's prefetched ahead) is added to the transient of every
block that is not offloaded after the first offloaded one, and to the outside transient when any
block is offloaded (an offloaded block's own transient was measured among offloaded blocks).

The part outside the blocks has choices too: ``keep``, or its saved tensors offloaded through the
same shared schedule (``Profile.outside``, measured with the blocks recomputed). Offloaded, its
embeddings' tensors come before every block, so the window is resident during every block that is
not offloaded. The solver runs once per outside choice and keeps the fastest.

A choice that planning could not measure within the budget (``profile.INFEASIBLE``: its
measurement alone went over, so no plan using it fits) is never picked.

Risk. Measured times carry noise, and offloading's time depends on a storage tier and on threads
that share the cores with compute. Its estimate is already the busy machine's (costs.py: its copies'
processor time charged in full); the solver's objective adds a premium of ``RISK`` of a block's
computing time per offloaded block (and an offloaded outside part), so that computing is preferred
over moving data unless the offload is measured faster beyond its noise (HF GPT-2 8x384, one block
at --budget 0.3: selective over offload:disk measured 0.939-1.010 across six processes, idle and
with two cores kept busy; with a 1% premium and the 3% near-tie, a clean-clone CI run planned the
block differently idle and busy); no choice counts as faster than keep (each does keep's
work and more: measured faster is noise). The solver takes the least objective, in whole
microseconds (exact sums, so equal predictions tie exactly), and puts identical blocks' choices in
one order (``canonical``). Where the plan lies is then fixed by the budget against measured bytes,
which load barely moves. (An earlier rule, "the least peak among plans within 3% of the best",
picked a plan at the edge of that band, where a 1% change in one measured time moved it: on HF
GPT-2 and Llama 8x512 the plans differed idle and busy at 0.47 and 0.35 of no checkpointing, and
between two idle runs; solved on the same profiles, the fastest plan did not. Before that, "an
offloading plan gives way to the best one that does not within 3%" took recompute and selective at
1.28x of no checkpointing where disk offload alone ran at 1.14x.)

Near-ties. Two choices of one block measured a fraction of a percent of the step apart (HF GPT-2
8x384 at --budget 0.3: selective 254.6 ms, offload:disk 256.1 ms, 1.7% of keep's time apart with the
premium; 2-8% in other runs, idle and busy) were decided by which was measured faster, so the plan
differed between processes. A choice now beats one before it in ``PREFERENCE`` (keep, selective,
selective-alt, recompute, offload, recompute+offload: fewer moving parts first) only by more than
``TIE`` (3%) of the block's computing time: within that, its value is raised to the other's
(``_near_ties``) and the order, the objective's least significant digits, decides, whichever of the
two was measured faster. Per block, against fixed values: unlike "the least peak within 3% of the
fastest", nothing is minimised inside the band, so the solver never seeks its edge; a plan flips only
where a difference measured within noise of 3% of a block's time is, and the plan it takes instead is
at most that much slower per block. The tolerance is a fixed share, not the spread measured in this
run: a band that widened under load would itself make a busy machine plan otherwise. The part outside
the blocks is treated alike (kept, then offloaded, then chunked heads). A larger budget never raises
the objective; the predicted time may rise within near-ties (a preferred choice that now fits).

The max is handled exactly by dynamic programming over blocks x prefix held bytes x "an offloaded
block came before": choosing block i's option is allowed only if prefix + held + transient (+ the
window) fits, and the final prefix must leave room for the outside transient. Bytes are counted in units fixed by the profile (not by the budget) and
rounded up, so a larger budget only ever adds feasible plans: the optimum's objective never increases,
and the prediction errs towards more memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .budget import format_bytes
from .choices import is_offload, split_outside
from .profile import INFEASIBLE, Profile, feasible

UNITS = 4096
"""Resolution of the held-bytes axis: the largest possible held total spans this many units."""
RISK = 0.05
"""Premium, as a share of a block's computing time, charged for offloading it (see the docstring):
offloading's time alone is the noisiest estimate (its copies' threads and the storage tier), so an
offload beats a computing choice only by more than this plus ``TIE``."""
TIE = 0.03
"""Near-tie tolerance, as a share of a block's (or the outside part's) computing time: a choice
counts as faster than one before it in ``PREFERENCE`` only by more than this (``_near_ties``)."""
PREFERENCE = ("keep", "selective", "selective-alt", "recompute", "offload", "recompute+offload")
"""The fixed order near-ties go by, fewer moving parts first: computing before moving data, and of
the computing choices, the one recomputing least first (tiers of one kind in the order listed)."""
NOISE = 0.03
"""A chunked head predicted faster by less than this share is not taken (``solve``)."""


@dataclass
class Solution:
    """One solved assignment with its predictions."""

    choices: list[str]
    held: int
    peak: int
    seconds: float
    outside: str = "keep"


class BudgetTooSmall(ValueError):
    """The budget is below the least peak any combination of choices reaches. ``minimum`` is that
    peak; ``suggested``, a budget that plans (the minimum with room for what predictions miss);
    with the profile, the message names what dominates the least peak."""

    MARGIN = 0.05
    """Room above the least predicted peak in the suggested budget: the least plan is verified as the
    process sees it, and a suggestion exactly at the prediction fails on any error in it."""

    @classmethod
    def forward_alone(cls, budget: object, stop: Any, no_checkpointing: int = 0, overhead: int = 0
                      ) -> BudgetTooSmall:
        """One forward of the model, keeping nothing for backward, went over the budget (a share of
        no checkpointing's peak, which holds at least that): no plan fits. ``stop``: the guard's
        ``OverBudget`` (where, which operator, how many bytes). ``no_checkpointing``: that peak,
        from a step on fake tensors where it ran: running without checkpointing needs it (and
        ``overhead``, what the process held besides), so a budget with it, and room for what
        tensors do not show, plans; else ``UNMEASURED`` times what the forward would have held."""
        error = cls.__new__(cls)
        error.budget, error.minimum, error.overhead, error.profile = 0, INFEASIBLE, overhead, None
        error.parts = [(f"{stop.what}: {stop.operator or 'an operator'} would have made", stop.size)] if stop.size else []
        error.suggested = (int((no_checkpointing + overhead) * (1 + 2 * cls.MARGIN)) if no_checkpointing
                           else UNMEASURED * stop.used)
        made = f" ({stop.operator} would have made {format_bytes(stop.size)} of output)" if stop.size else ""
        share = "of no checkpointing's peak can be" if isinstance(budget, (float, str)) and \
            "." in str(budget) and not str(budget).lower().endswith("b") else "allows"
        ValueError.__init__(error, f"one forward of the model, keeping nothing for backward, needs more than the "
                                   f"budget {budget} {share}: in {stop.what}{made} the process would have held "
                                   f"{format_bytes(stop.used)} above the step's start")
        return error

    def __init__(self, budget: int, minimum: int, overhead: int = 0, profile: Profile | None = None) -> None:
        self.budget, self.minimum, self.overhead = budget, minimum, overhead
        self.profile = profile
        """The profile solved (``None`` where the forward alone went over): what the minimum is of."""
        self.parts = breakdown(profile, overhead) if profile is not None and minimum < INFEASIBLE else []
        self.suggested = int(minimum * (1 + self.MARGIN)) if minimum < INFEASIBLE else 0
        if minimum >= INFEASIBLE:
            part = unmeasured(profile)
            reached = max((size for what, size in (profile.stops if profile is not None else {}).items()
                           if what.endswith(part.removeprefix("block ")) or part.startswith("the part outside")
                           and what.startswith("outside")), default=0)
            text = (f"budget {format_bytes(budget)} ({budget} bytes) is too small to measure any way of running "
                    f"{part} within it" + (f": the least its measurements needed was over {format_bytes(reached)}"
                                           if reached else ""))
            self.suggested = suggest_unmeasured(profile, budget) if profile is not None else 2 * budget
        else:
            text = (f"budget {format_bytes(budget)} ({budget} bytes) is below the least achievable peak activation "
                    f"memory, {format_bytes(minimum)} ({minimum} bytes), with these choices")
            if self.parts:
                text += "; of that peak " + ", ".join(f"{what} {format_bytes(size)}" for what, size in self.parts[:3])
        super().__init__(text)


def unit_of(profile: Profile) -> int:
    """Bytes per unit of the memory axis for ``profile``."""
    most = sum(max((v for c, v in b.held.items() if feasible(b, c)), default=0) for b in profile.blocks) + max(
        (v for b in profile.blocks for c, v in b.transient.items() if feasible(b, c)), default=0) + profile.window()
    return max(1, math.ceil(most / UNITS))


def _up(size: int, unit: int) -> int:
    return -(-size // unit)


def rounded_peak(profile: Profile, assignment: list[str], outside: str = "keep") -> int:
    """The predicted peak of ``assignment`` as the solver counts it (block bytes rounded up)."""
    unit = unit_of(profile)
    other_held, other_transient, _ = profile.other(outside)
    window, seen, first = _up(profile.window(), unit) * unit, False, is_offload(outside)
    if other_held >= INFEASIBLE or not all(feasible(b, c) for b, c in zip(profile.blocks, assignment, strict=True)):
        return INFEASIBLE
    prefix, worst = 0, 0
    for block, choice in zip(profile.blocks, assignment, strict=True):
        prefix += _up(block.held[choice], unit) * unit
        worst = max(worst, prefix + _up(block.transient[choice], unit) * unit
                    + (window if (seen or first) and not is_offload(choice) else 0))
        seen = seen or is_offload(choice)
    return max(profile.back(outside) + worst, other_held + prefix + other_transient + (window if seen else 0))


def minimum_peak(profile: Profile) -> int:
    """The least predicted peak over all assignments (bisection on the solver's feasibility)."""
    outsides = profile.outside_choices()
    if not outsides or not all(any(feasible(b, c) for c in profile.choices) for b in profile.blocks):
        return INFEASIBLE
    least = [min((c for c in profile.choices if feasible(b, c)), key=lambda c, b=b: (b.held[c], b.transient[c]))
             for b in profile.blocks]
    low = min(sum(profile.other(o)[:2]) for o in outsides)
    high = max(min(rounded_peak(profile, least, o) for o in outsides), low)
    while low < high:
        middle = (low + high) // 2
        if all(_search(profile, middle, o) is None for o in outsides):
            low = middle + 1
        else:
            high = middle
    return low


def _rank(choices: list[str]) -> list[int]:
    """Each choice's place in ``PREFERENCE`` (by its kind, then the order listed; an unknown kind,
    such as the outside part's ``loss`` or ``head``, after every known one, in the order listed)."""
    def key(index: int) -> tuple[int, int]:
        kind = choices[index].split(":")[0]
        return (PREFERENCE.index(kind) if kind in PREFERENCE else len(PREFERENCE), index)
    order = sorted(range(len(choices)), key=key)
    return [order.index(i) for i in range(len(choices))]


def _near_ties(values: list[float], rank: list[int], tolerance: float) -> list[float]:
    """``values`` (one part's per choice; inf: not usable) with each raised to the value of a choice
    before it in ``rank`` that is at most ``tolerance`` above it: a choice beats one it comes after
    only by more than the tolerance, and within it the choice first in the order wins (``_objective``
    ranks it first among exact ties). Each is raised by at most ``tolerance``."""
    tied = list(values)
    for index in sorted(range(len(values)), key=rank.__getitem__):
        if not math.isfinite(values[index]):
            continue
        before = [tied[j] for j in range(len(values)) if rank[j] < rank[index] and math.isfinite(tied[j])
                  and tied[j] <= values[index] + tolerance]
        tied[index] = max([values[index], *before])
    return tied


def _objective(profile: Profile, choices: list[str]) -> np.ndarray:
    """Per block and choice, the seconds the solver minimises: the predicted time, plus the risk
    premium for offloading (``RISK`` of the block's fastest computing choice), near-ties raised
    (``_near_ties``, ``TIE`` of that time), in whole microseconds."""
    rank = _rank(choices)
    rows = []
    for block in profile.blocks:
        computing = [block.seconds[c] for c in choices if not is_offload(c) and feasible(block, c)]
        reference = min(computing) if computing else min(block.seconds[c] for c in choices)
        # every choice does keep's work and more (recompute, copies): one measured faster is noise
        floor = block.seconds["keep"] if "keep" in block.seconds and feasible(block, "keep") else 0.0
        values = [max(block.seconds[c], floor) + (RISK * reference if "offload" in c else 0.0)
                  if feasible(block, c) else math.inf for c in choices]
        rows.append(_near_ties(values, rank, TIE * reference))
    # Whole microseconds: their sums are exact in float64 whatever the order, so assignments that
    # differ only in which identical block takes which choice tie exactly and the first one found wins
    # (with fractional seconds, rounding in the sums picked one at random, run to run).
    return np.round(np.array(rows) * 1e6)


def _scale(profile: Profile, choices: list[str]) -> int:
    """The base ``_ranked`` writes time in: above any sum of places over the blocks and the outside part."""
    return (len(profile.blocks) + 1) * (max(len(choices), len(profile.outside) + 1))


def _ranked(profile: Profile, choices: list[str]) -> np.ndarray:
    """``_objective`` with each choice's place in ``PREFERENCE`` as the least significant digits (base
    ``_scale``): least time first, then, among exact ties (near-ties raised to one value), the
    choices first in the order, whatever their bytes. Integers below 2**53: sums stay exact."""
    return _objective(profile, choices) * _scale(profile, choices) + np.array(_rank(choices))


def _search(profile: Profile, budget: int, outside: str = "keep", choices: list[str] | None = None
            ) -> list[int] | None:
    """Indexes into ``choices`` (default ``profile.choices``) of the least-objective assignment
    whose predicted peak fits ``budget``, None if none does."""
    choices = profile.choices if choices is None else choices
    unit = unit_of(profile)
    other_held, other_transient, _ = profile.other(outside)
    if other_held >= INFEASIBLE:
        return None
    first = is_offload(outside)
    room = budget - other_held  # at the head's time: every block's held bytes and the head's
    if room < other_transient:
        return None
    window = _up(profile.window(), unit)
    size = (budget - profile.back(outside)) // unit  # while the blocks run (at least room)
    final = [(room - other_transient) // unit, (room - other_transient) // unit - window]
    usable = np.array([[feasible(b, c) for c in choices] for b in profile.blocks], dtype=bool)
    held = np.array([[_up(b.held[c], unit) if feasible(b, c) else 0 for c in choices] for b in profile.blocks],
                    dtype=np.int64)
    transient = np.array([[_up(b.transient[c], unit) if feasible(b, c) else 0 for c in choices]
                          for b in profile.blocks], dtype=np.int64)
    seconds = _ranked(profile, choices)
    offloads = [is_offload(c) for c in choices]
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
            if not usable[block, choice]:
                continue
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


def _outside_seconds(profile: Profile, outside: str) -> float:
    """The part outside the blocks' seconds as ``outside``, at least those of the same choice without
    its offload (copies only add work: measured faster, it is noise, and a CI run under load took an
    offloaded outside part that nothing needed on such a measurement)."""
    seconds = profile.other(outside)[2]
    if is_offload(outside):
        base = split_outside(outside)[1] or "keep"
        if base in profile.outside_choices():
            seconds = max(seconds, profile.other(base)[2])
    return seconds


def _outside_ranked(profile: Profile, choices: list[str]) -> dict[str, float]:
    """Per measured choice for the part outside the blocks, what ``_ranked`` is for a block's: its
    seconds (``_outside_seconds``) plus the risk premium when offloaded, near-ties raised in the order
    plain before chunked (``solve``), kept before offloaded, in whole microseconds, its place last."""
    outsides = profile.outside_choices()
    keep = profile.other("keep")[2]
    order = sorted(range(len(outsides)), key=lambda i: (split_outside(outsides[i])[1] is not None,
                                                          is_offload(outsides[i]), i))
    rank = [order.index(i) for i in range(len(outsides))]
    values = _near_ties([_outside_seconds(profile, o) + (RISK * keep if is_offload(o) else 0.0) for o in outsides],
                        rank, TIE * keep)
    scale = _scale(profile, choices)
    return {o: float(np.round(1e6 * v)) * scale + r for o, v, r in zip(outsides, values, rank, strict=True)}


def _best(profile: Profile, budget: int, choices: list[str], outsides: list[str]) -> tuple[float, Solution] | None:
    """``(objective, solution)`` of the least-objective assignment fitting ``budget``."""
    best: tuple[float, Solution] | None = None
    table = _ranked(profile, choices)
    outside_table = _outside_ranked(profile, choices)
    for outside in outsides:
        picked = _search(profile, budget, outside, choices)
        if picked is None:
            continue
        names = [choices[i] for i in picked]
        found = Solution(names, profile.held_of(names, outside), rounded_peak(profile, names, outside),
                         profile.seconds_of(names, outside), outside)
        objective = float(table[np.arange(len(names)), picked].sum()) + outside_table[outside]
        if best is None or objective < best[0]:
            best = (objective, found)
    return best


def fastest(profile: Profile, budget: int, outsides: list[str] | None = None) -> Solution | None:
    """The least-objective assignment fitting ``budget`` (the part outside the blocks as one of
    ``outsides``, default every measured choice), identical blocks in ``canonical`` order; None if
    none fits."""
    found = _best(profile, budget, profile.choices, profile.outside_choices() if outsides is None else outsides)
    return canonical(profile, found[1], budget) if found is not None else None


def canonical(profile: Profile, found: Solution, budget: int) -> Solution:
    """``found`` with the choices of identical blocks (equal measurements: the same predicted time
    wherever each goes) in one order: least held bytes first, or most first, whichever peaks less
    within ``budget``. Which identical block keeps and which offloads changes no predicted time, only
    the peak a little; without one order, plans with equal predictions differed run to run in that."""
    classes: dict[str, list[int]] = {}
    for index, block in enumerate(profile.blocks):
        key = repr((sorted(block.held.items()), sorted(block.transient.items()), sorted(block.seconds.items()),
                    sorted(block.window.items())))
        classes.setdefault(key, []).append(index)
    rank = {choice: index for index, choice in enumerate(profile.choices)}
    orders = []
    for descending in (False, True):
        choices = list(found.choices)
        for positions in classes.values():
            block = profile.blocks[positions[0]]
            ranked = sorted((choices[i] for i in positions), reverse=descending,
                            key=lambda c, b=block: (b.held[c], b.transient[c], -rank[c] if descending else rank[c]))
            for index, choice in zip(positions, ranked, strict=True):
                choices[index] = choice
        orders.append((rounded_peak(profile, choices, found.outside), descending, choices))
    peak, _, choices = min(orders)
    if peak > budget or choices == found.choices:
        return found
    return Solution(choices, profile.held_of(choices, found.outside), peak, profile.seconds_of(choices, found.outside),
                    found.outside)


def solve(profile: Profile, budget: int) -> Solution:
    """The fastest assignment (blocks and the part outside them) whose predicted peak is at most
    ``budget`` bytes (``BudgetTooSmall`` naming the least achievable peak otherwise), offloading
    charged its risk, identical blocks in ``canonical`` order (module docstring). On equal time the
    outside part is kept (it is listed first)."""
    outsides = profile.outside_choices()
    best = fastest(profile, budget, outsides)
    if best is None:
        raise BudgetTooSmall(budget, minimum_peak(profile))
    if split_outside(best.outside)[1] is not None:
        # The chunked head (acshim.head) recomputes in backward: taken when it is needed to fit or
        # faster beyond noise (a prediction within NOISE of the plain head's is no reason to take it).
        plain = [o for o in outsides if split_outside(o)[1] is None]
        without = fastest(profile, budget, plain) if plain else None
        if without is not None and without.seconds <= best.seconds * (1 + NOISE):
            best = without
    return best


def least_plan(profile: Profile) -> tuple[list[str], str] | None:
    """The assignment reaching the least predicted peak (None if no choice fits for some block)."""
    least = minimum_peak(profile)
    if least >= INFEASIBLE:
        return None
    for outside in profile.outside_choices():
        picked = _search(profile, least, outside)
        if picked is not None:
            return [profile.choices[i] for i in picked], outside
    return None


def breakdown(profile: Profile, overhead: int = 0) -> list[tuple[str, int]]:
    """What the least peak is made of, largest first: the part outside the blocks (held after
    forward, and its backward's transient), the blocks' held bytes, the largest block transient,
    the offload window, and what the process held besides (``overhead``)."""
    found = least_plan(profile)
    if found is None:
        return []
    choices, outside = found
    other_held, other_transient, _ = profile.other(outside)
    blocks = [(b, c) for b, c in zip(profile.blocks, choices, strict=True)]
    held = sum(b.held[c] for b, c in blocks)
    widest = max(blocks, key=lambda bc: bc[0].transient[bc[1]])
    parts = [(f"the part outside the blocks (embeddings, head, loss; {outside}) holds", other_held),
             ("its backward (the head's gradients, the loss) adds up to", other_transient),
             (f"the blocks hold ({', '.join(sorted(set(choices)))})", held),
             (f"the largest block transient ({widest[0].name} as {widest[1]}) is", widest[0].transient[widest[1]]),
             ("the offload window is", profile.window() if profile.offloads(choices, outside) else 0),
             ("the process held besides (the step's first part, worker threads, buffers)", overhead)]
    return sorted([p for p in parts if p[1] > 0], key=lambda p: -p[1])


def unmeasured(profile: Profile | None) -> str:
    """Which part of the model had no choice measured within the budget."""
    if profile is None:
        return "the model"
    if not profile.outside_choices():
        return "the part outside the blocks (embeddings, head, loss)"
    for block in profile.blocks:
        if not any(feasible(block, c) for c in profile.choices):
            return f"block {block.name}"
    return "the model"


UNMEASURED = 3
"""A part stopped on its way over the budget needs more than it held then; the suggestion for it is
this many times that (an LM head's logits are followed by the loss's copy of them and their gradient)."""


def suggest_unmeasured(profile: Profile, budget: int) -> int:
    """A bound for what could not be measured within ``budget``: ``UNMEASURED`` times what the process
    held when the part was stopped. A single process's refusal measures the part again within it and
    names the frontier's least budget then (``refusal.Refusal.measure_stopped``); ranks planning
    together name the bound."""
    reached = max(profile.stops.values(), default=0)
    return max(budget + 1, UNMEASURED * reached)
