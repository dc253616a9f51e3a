"""The ``Plan`` a budget gives (its apply, save and load), and solving a profile within a budget
(``solve_within``, with verification and re-solves); ``acshim.plan`` itself is in ``planner.api``."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from .budget import format_bytes, parse_budget
from .choices import (
    SharedOffload,
    install,
    install_outside,
    is_offload,
    offload_scopes,
    split_outside,
)
from .probe import probe_offload
from .profile import INFEASIBLE, Profile, feasible, model_signature
from .solver import BudgetTooSmall, Solution, minimum_peak, rounded_peak, solve, unit_of

FORMAT = "acshim-plan/1"

HEADROOM = 0.03
"""A plan is accepted when its verification step peaked this share below the budget: room for what
sampling between operators cannot see in later steps (operators' scratch memory, copies in flight
that land at other moments)."""


@dataclass
class FrontierPoint:
    """One point of the memory vs step-time frontier."""

    budget: int
    peak: int
    held: int
    seconds: float
    choices: list[str]
    outside: str = "keep"


@dataclass
class Plan:
    """A per-block choice under a peak activation-memory budget, with the predictions it was chosen on.

    ``apply(model)`` installs it in place (``acshim.remove_checkpointing`` undoes it); ``save`` /
    ``Plan.load`` reuse it without profiling again; ``str(plan)`` is a table; ``frontier()`` sweeps
    budgets over the same profile.
    """

    budget: int
    blocks: list[str]
    choices: list[str]
    held: int
    peak: int
    seconds: float
    profile: Profile
    measured_peak: int | None = None
    """The tracker's peak (tensor storages) on the verification step."""
    measured_held: int | None = None
    measured_process_peak: int | None = None
    """The process's peak above the step's start on the verification step (resident set on CPU,
    reserved on a GPU): what the budget is about. None where it could not be read."""
    reference_peak: int = 0
    reference_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    overhead: int = 0
    """What the process held above the step's start besides the plan's activations when it was solved
    (the interrupted step's first part, worker threads, code paged in): left room for."""
    verified_seconds: float | None = None
    """The verification step's time (untracked, operator by operator as the profile)."""
    outside: str = "keep"
    """The choice for the part of the model outside the blocks (embeddings, head, loss inside the
    forward): ``keep`` or ``offload:TIER``, through the offloaded blocks' schedule."""
    in_flight: int = SharedOffload.IN_FLIGHT
    """Bytes of copies out the offloaded blocks' schedule lets be in flight: the profiles' own
    (``SharedOffload.IN_FLIGHT``), plus the room the budget leaves above the predicted peak and then
    above the verification step's measured peak, up to ``SharedOffload.MAX_IN_FLIGHT`` in all; the
    extra is in ``peak`` (the more in flight, the less forward waits on a slow tier)."""
    least_budget: int = 0
    """The least budget that plans this model and batch, from this profile (``least_budget``): what
    a refusal names and ``acshim plan --sweep`` prints as the frontier's start (0: not known)."""
    asked: str | None = None
    """On a pipeline stage, the budget as asked (``--budget``), of which ``budget`` is one microbatch's
    share: a stage's plan file is reused for the same budget asked (``load_plan_file``)."""
    rank_budget: int = 0
    """On a pipeline stage, the rank's bytes that share was taken from (0 elsewhere)."""

    # -------------------------------------------------------------------------------- apply
    def apply(self, model: nn.Module) -> list[str]:
        """Install the plan on ``model`` in place; returns the names of the blocks made regions. A
        model other than the one planned for raises ``ValueError`` and is left untouched."""
        blocks = self._blocks_of(model)
        # the offloaded blocks share one schedule per tier
        shared = offload_scopes(self.choices, self.outside, self.profile.prefetch, self.in_flight)
        within = is_offload(self.outside)
        for (_, block), choice in zip(blocks, self.choices, strict=True):
            install(block, choice, self.profile.prefetch, shared, within_offload=within)
        install_outside(model, self.outside, self.profile.prefetch, shared)
        return [name for name, choice in zip(self.blocks, self.choices, strict=True) if choice != "keep"]

    def _blocks_of(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        if not isinstance(model, nn.Module):
            raise TypeError(f"Plan.apply needs an nn.Module, got {type(model).__name__}")
        found = dict(model.named_modules())
        missing = [name for name in self.blocks if name not in found]
        blocks = [(name, found[name]) for name in self.blocks if name in found]
        if missing or model_signature(model, blocks) != self.profile.signature:
            raise ValueError(f"this plan was made for another model (blocks {self.blocks[:3]}..., signature "
                             f"{self.profile.signature}); plan again for {type(model).__name__}")
        return blocks

    @classmethod
    def from_choices(cls, base: Plan, choices: list[str], outside: str = "keep") -> Plan:
        """A plan with ``base``'s profile and the given per-block ``choices`` and ``outside`` choice
        (predictions recomputed)."""
        unknown = sorted(set(choices) - set(base.profile.choices))
        if len(choices) != len(base.blocks) or unknown:
            raise ValueError(f"need one profiled choice per block ({len(base.blocks)}); unknown: {unknown}")
        profile = base.profile
        profile.other(outside)  # ValueError for an outside choice that was not profiled
        return cls(base.budget, list(base.blocks), list(choices), profile.held_of(choices, outside),
                   profile.peak_of(choices, outside), profile.seconds_of(choices, outside), profile,
                   reference_peak=base.reference_peak, reference_seconds=base.reference_seconds, outside=outside)

    # -------------------------------------------------------------------------------- persistence
    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict of the plan and its profile."""
        data = {k: v for k, v in vars(self).items() if k != "profile"}
        return {"format": FORMAT, **data, "profile": self.profile.to_json()}

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan (and its profile) as JSON."""
        with open(path, "w", encoding="utf-8") as file:
            json.dump(self.to_json(), file, indent=1)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        """Read a plan written by ``save``."""
        with open(path, encoding="utf-8") as file:
            data = json.load(file)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{os.fspath(path)} is not an acshim plan (format {FORMAT})")
        return cls.from_json(data)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Plan:
        """The plan ``to_json`` gave."""
        data = {k: v for k, v in data.items() if k != "format"}
        data["profile"] = Profile.from_json(data["profile"])
        return cls(**data)

    # -------------------------------------------------------------------------------- reporting
    def __str__(self) -> str:
        ref_peak, ref_seconds = self.reference_peak or 1, self.reference_seconds or 1.0
        rows = [f"acshim plan: budget {format_bytes(self.budget)} (peak activation memory)",
                f"{'block':<24} {'choice':<24} {'held':>10} {'transient':>10} {'ms':>8}"]
        for block, name, choice in zip(self.profile.blocks, self.blocks, self.choices, strict=True):
            rows.append(f"{name:<24} {choice:<24} {format_bytes(block.held[choice]):>10} "
                        f"{format_bytes(block.transient[choice]):>10} {block.seconds[choice] * 1e3:>8.1f}")
        other_held, other_transient, other_seconds = self.profile.other(self.outside)
        rows.append(f"{'(outside blocks)':<24} {self.outside:<24} {format_bytes(other_held):>10} "
                    f"{format_bytes(other_transient):>10} {other_seconds * 1e3:>8.1f}")
        if self.overhead:
            rows.append(f"held besides the activations when solved: {format_bytes(self.overhead)} (left room for)")
        activations = (f"held {format_bytes(self.held)}, peak {format_bytes(self.peak)} "
                       f"({self.peak / ref_peak:.2f}x no checkpointing)")
        if self.overhead:  # the whole step, comparable with the process's measured peak
            activations = (f"whole step {format_bytes(self.peak + self.overhead)} (activations {activations}; "
                           f"{format_bytes(self.overhead)} held besides)")
        rows.append(f"predicted: {activations}, step {self.seconds * 1e3:.1f} ms ({self.seconds / ref_seconds:.2f}x)")
        if self.in_flight > SharedOffload.IN_FLIGHT:
            extra = self.in_flight - SharedOffload.IN_FLIGHT
            rise = (self.profile.peak_of(self.choices, self.outside, extra)
                    - self.profile.peak_of(self.choices, self.outside))
            rows.append(f"copies out in flight: up to {format_bytes(self.in_flight)} (room left under the budget; "
                        f"{format_bytes(extra)} beyond the profiles' own, adding {format_bytes(rise)} to the "
                        "predicted peak where they can be in flight)")
        if self.measured_process_peak is not None:  # read from the process (``profiler.verify``)
            rows.append(f"measured after apply: whole step {format_bytes(self.measured_process_peak)} above the "
                        f"step's start (the process's memory, with what is charged besides), "
                        f"{self.measured_process_peak / max(1, self.peak + self.overhead):.2f}x the prediction")
        elif self.measured_peak is not None:
            rows.append(f"measured after apply: held {format_bytes(self.measured_held or 0)}, "
                        f"peak {format_bytes(self.measured_peak)} (tensor storages)")
        rows.append(f"profile: {self.profile.method}")
        rows += [f"note: {note}" for note in self.notes]
        return "\n".join(rows)

    def describe(self) -> str:
        """``"5 recompute, 2 selective, 1 keep"`` (and the outside part's choice when not kept)."""
        counts: dict[str, int] = {}
        for choice in self.choices:
            counts[choice] = counts.get(choice, 0) + 1
        outside = "" if self.outside == "keep" else f"; outside the regions: {self.outside}"
        return ", ".join(f"{n} {c}" for c, n in counts.items()) + outside

    def frontier(self, budgets: Iterable[int | float | str] | None = None) -> list[FrontierPoint]:
        """Predicted (peak, step time) of the best plan at each budget (default: 10 budgets from the
        least achievable peak to no checkpointing's), from this plan's profile."""
        low = minimum_peak(self.profile)
        if low >= INFEASIBLE:
            return []
        high = max(self.reference_peak, low)
        if budgets is None:
            values = [int(low + (high - low) * i / 9) for i in range(10)]
        else:
            values = [parse_budget(b, self.reference_peak) for b in budgets]
        points = []
        for budget in values:
            try:
                found = solve(self.profile, budget)
            except BudgetTooSmall:
                continue
            points.append(FrontierPoint(budget, found.peak, found.held, found.seconds, found.choices, found.outside))
        return points


def reference(profile: Profile) -> tuple[int, float]:
    """Predicted (peak, seconds) of the step without checkpointing, from the profile (the model never
    runs so). Where keeping a block could not be measured within the budget, its held bytes are what
    its forward saves (counted) and its transient that of its recompute beyond them; the peak is
    never below ``profile.unchecked_floor``."""
    keep = ["keep"] * len(profile.blocks)
    if "keep" not in profile.choices:
        return 0, 0.0
    if all(feasible(b, "keep") for b in profile.blocks) and profile.other_held < INFEASIBLE:
        return max(rounded_peak(profile, keep), profile.unchecked_floor), profile.seconds_of(keep)
    blocks = []
    for block in profile.blocks:
        if feasible(block, "keep"):
            blocks.append(block)
            continue
        measured = [c for c in profile.choices if feasible(block, c)]
        transient = max((block.transient[c] for c in measured), default=block.saved)
        seconds = min((block.seconds[c] for c in measured), default=0.0)
        blocks.append(replace(block, held={**block.held, "keep": block.saved},
                              transient={**block.transient, "keep": max(0, transient - block.saved)},
                              seconds={**block.seconds, "keep": seconds}))
    estimated = replace(profile, blocks=blocks)
    if profile.other_held >= INFEASIBLE:
        estimated.other_held, estimated.other_transient = profile.other_saved, profile.other_saved
        estimated.other_seconds = min((float(e["seconds"]) for e in profile.outside.values()), default=0.0)
    return max(estimated.peak_of(keep), profile.unchecked_floor), estimated.seconds_of(keep)


def least_budget(profile: Profile, overhead: int = 0, measured: Callable[[list[str], str], int] | None = None,
                 guarded: Callable[[int], int] | None = None) -> int:
    """The least budget that plans, from the planner's own frontier: its least predicted peak
    (``minimum_peak``) plus ``overhead`` (what the process held besides when solving), over
    ``1 - HEADROOM`` (the verification's acceptance), and no less than the most any measurement the
    least plan needs reached (``measured(choices, outside)``: ``RegionProfiler.needed_for``) as
    ``guarded`` makes it a budget (``process.guarded_budget``: the guard stops measurements below the
    budget); then ``BudgetTooSmall.MARGIN``
    more, for what one measurement to the next varies. 0 where no plan was measured at all."""
    low = minimum_peak(profile)
    if low >= INFEASIBLE:
        return 0
    try:
        found = solve(profile, low)
    except BudgetTooSmall:
        return 0
    need = math.ceil((low + overhead) / (1 - HEADROOM))
    if measured is not None:
        reached = measured(found.choices, found.outside)
        need = max(need, guarded(reached) if guarded is not None else reached)
    return math.ceil(need * (1 + BudgetTooSmall.MARGIN))


def solve_within(profile: Profile, budget: int | float | str, measure: Callable[[Plan], Any] | None, *,
                 retries: int = 6, overhead: int = 0, skip: tuple[list[str], str] | None = None,
                 probe: bool = False) -> Plan:
    """The fastest plan of ``profile`` under ``budget``; with ``measure`` (a candidate plan -> a
    ``profiler.Verification``) a plan measured over budget, by the process where it can be read,
    is re-solved under a tighter target, and never returned over budget. ``overhead``: what the
    process already holds above the step's start that no block profile counts (the interrupted
    step's first part, worker threads, their buffers): the first target is the budget less it.
    ``BudgetTooSmall`` names the least achievable peak. When the re-solves run out and offload was
    among the choices, the choices that offload nothing are solved once more: copies still in
    flight to a slow tier (a loaded machine) can keep an offloading plan over budget however it is
    tightened, while recompute's memory does not vary. ``skip``: a plan already verified (re-solving
    at run time): returned unverified if solved again. ``probe`` (with ``measure``): the verified
    plan is compared with the plan that free copies would give, on one measured step, and the
    faster taken (``probe.probe_offload``), where the first plan solved was the one verified (after
    re-solves the predictions ran low, and a plan solved at the first target may well be over too)."""
    verified: list[Plan] = []

    def counted(plan: Plan) -> Any:
        verified.append(plan)
        return measure(plan)  # type: ignore[misc]

    try:
        found = _solve_within(profile, budget, counted if measure is not None else None, retries, overhead, skip)
    except BudgetTooSmall:
        raise
    except ValueError as error:
        offloads = [c for c in profile.choices if "offload" in c]
        if measure is None or not (offloads or profile.outside):
            raise
        kept = [c for c in profile.choices if c not in offloads]
        restricted = replace(profile, choices=kept, outside={k: v for k, v in profile.outside.items() if not is_offload(k)},
                             blocks=[replace(b, held={c: b.held[c] for c in kept},
                                             transient={c: b.transient[c] for c in kept},
                                             seconds={c: b.seconds[c] for c in kept}, window={})
                                     for b in profile.blocks])
        try:
            result = _solve_within(restricted, budget, measure, retries, overhead, skip)
        except ValueError:
            raise error from None
        result.notes.append(f"offloading plans stayed over budget when measured ({error}); solved again without "
                            "offload (copies in flight to a slow tier add to the peak on a loaded machine)")
        return result
    if not probe or measure is None or len(verified) != 1:
        return found
    return probe_offload(found, int(found.budget * (1 - HEADROOM)), measure,
                         lambda free: _solve_within(free, budget, None, retries, overhead, None))


def _solve_within(profile: Profile, budget: int | float | str, measure: Callable[[Plan], Any] | None,
                  retries: int, overhead: int, skip: tuple[list[str], str] | None) -> Plan:
    reference_peak, reference_seconds = reference(profile)
    budget_bytes = parse_budget(budget, reference_peak or int(profile.recompute_step.get("saved", 0)))
    notes = []
    if reference_peak == 0:
        notes.append("'keep' not among the choices: ratios are not shown")
    accept = int(budget_bytes * (1 - HEADROOM))
    target = accept - overhead
    seen_peaks: list[str] = []
    least_seen: int | None = None  # what the least plan (the frontier's start) measured, once verified
    # the least plan's predicted peak (the frontier's start): only verified solves measure it
    least_tried, floor = False, minimum_peak(profile) if measure is not None else 0
    attempt = 0
    while True:
        try:
            found: Solution = solve(profile, target)
        except BudgetTooSmall as error:
            if attempt == 0:  # the least peak with what the process holds besides, and the headroom
                least = math.ceil((error.minimum + overhead) / (1 - HEADROOM))
                raise BudgetTooSmall(budget_bytes, least, overhead, profile) from None
            if not least_tried and measure is not None:  # tightened past the frontier's start: measure it
                target, least_tried = error.minimum, True
                continue
            raise NoPlanMeasured(
                f"no plan measured within the budget {format_bytes(budget_bytes)}: predictions were low by up to "
                f"{format_bytes(budget_bytes - overhead - target)} and the tightened budget is below the least "
                f"achievable peak {format_bytes(error.minimum + overhead)} ({'; '.join(seen_peaks)})", least_seen
            ) from None
        attempt += 1
        is_least = found.peak <= floor
        least_tried = least_tried or is_least
        extra, rise = _extra_in_flight(profile, found, target - found.peak)
        result = Plan(budget_bytes, [b.name for b in profile.blocks], found.choices, found.held, found.peak + rise,
                      found.seconds, profile, reference_peak=reference_peak, reference_seconds=reference_seconds,
                      notes=list(notes), outside=found.outside, overhead=overhead,
                      in_flight=SharedOffload.IN_FLIGHT + extra)
        if measure is None or (skip is not None and (found.choices, found.outside) == skip):
            return result
        verified = measure(result)
        result.measured_held, result.measured_peak = verified.held, verified.peak
        result.measured_process_peak = verified.process_peak
        seen = verified.process_peak if verified.process_peak is not None else verified.peak
        if is_least:
            least_seen = INFEASIBLE if verified.stopped else seen
        seen_peaks.append(f"{format_bytes(result.peak + overhead)} predicted, "
                          f"{'over (stopped)' if verified.stopped else format_bytes(seen)} measured")
        if not verified.stopped and seen <= accept:
            result.verified_seconds = verified.seconds
            # copies in flight add to the peak where they can be in flight (Profile.peak_of): the room
            # the measurement left lets more be in flight where what they add fits it
            widen, rise = _extra_in_flight(profile, found, accept - seen, result.in_flight - SharedOffload.IN_FLIGHT)
            result.in_flight, result.peak = result.in_flight + widen, result.peak + rise
            if target != accept - overhead:
                result.notes.append(f"re-solved under {format_bytes(target)}: an earlier plan measured over budget")
            return result
        if verified.stopped:
            # stopped on its way over: where it stopped, the process held ``seen`` above the step's
            # start for the tracker's ``live_at_stop`` activation bytes (heap slack, copies in flight:
            # with glibc's default settings freed tensors stay in the heap). Scale the target for the
            # activations by that ratio (at most 1.3 at a time: where the heap keeps freed memory the
            # resident set runs ahead of the live bytes early in a step), and 2% more.
            if verified.live_at_stop > 0:
                ratio = min(1.3, max(1.0, (seen - overhead) / verified.live_at_stop))
                target = min(target - unit_of(profile), int(target / ratio) - budget_bytes // 50)
            else:  # measured by the process alone: 5% of the budget at a time
                target -= max(unit_of(profile), budget_bytes // 20)
        else:
            target -= max(seen - accept, unit_of(profile))
        if attempt > retries:
            if least_tried:
                break
            target, least_tried = floor, True  # the re-solves ran out: the frontier's start is measured last
    raise NoPlanMeasured(f"no plan measured within the budget {format_bytes(budget_bytes)} after {attempt - 1} "
                         f"re-solves ({'; '.join(seen_peaks)}; {format_bytes(overhead)} held besides when solving)",
                         least_seen)


class NoPlanMeasured(ValueError):
    """Every plan verified went over the budget, the least plan (the frontier's start) too: raised
    by ``solve_within`` once the re-solves tightened past it. ``least_seen``: what the least plan
    measured as the verification saw it (the process above the step's start, or the tracker's
    peak), ``INFEASIBLE`` where it was stopped on its way over, ``None`` where it was not verified;
    ``suggested``: a budget that measurement says plans (0 where it says none), which the caller
    re-verifies where it may (``refusal.Refusal.tested_suggestion``)."""

    def __init__(self, message: str, least_seen: int | None) -> None:
        super().__init__(message)
        self.least_seen = least_seen
        self.suggested = (math.ceil(least_seen / (1 - HEADROOM) * (1 + BudgetTooSmall.MARGIN))
                          if least_seen is not None and least_seen < INFEASIBLE else 0)
        self.why = (f"the least plan measured {format_bytes(least_seen)}, with the verification's {HEADROOM:.0%} "
                    f"headroom and {BudgetTooSmall.MARGIN:.0%} more" if self.suggested else "")


def _extra_in_flight(profile: Profile, found: Solution, room: int, already: int = 0) -> tuple[int, int]:
    """Bytes of copies in flight an offloading solution may have beyond the profiles' own and
    ``already`` granted, and what they add to its predicted peak (``Profile.peak_of``'s ``extra``:
    only where copies can be in flight, not in a backward their reads wait in): the most, up to
    ``SharedOffload.MAX_IN_FLIGHT`` in all, whose rise fits ``room`` (a tightened target after a plan
    measured over budget leaves less room)."""
    most = SharedOffload.MAX_IN_FLIGHT - SharedOffload.IN_FLIGHT - already
    if not profile.offloads(found.choices, split_outside(found.outside)[0]) or most <= 0 or room < 0:
        return 0, 0
    base = profile.peak_of(found.choices, found.outside, already)

    def rise(extra: int) -> int:
        return profile.peak_of(found.choices, found.outside, already + extra) - base

    low, high = 0, most  # the rise grows with the extra: the largest extra whose rise fits the room
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if rise(middle) <= room else (low, middle - 1)
    return low, rise(low)


class PlanFileMismatch(ValueError):
    """A saved plan does not fit this run (another model, batch shape or budget)."""


def stage_plan_file(path: str, stage: int) -> str:
    """Where pipeline stage ``stage`` keeps its plan when ``--plan-file path`` is given (each stage
    plans its own part, alone): ``plan.json`` -> ``plan.stage1.json``."""
    base, extension = os.path.splitext(path)
    return f"{base}.stage{stage}{extension}"


def load_plan_file(path: str, root: nn.Module, budget: int | float | str, shapes: list[list[int]]) -> Plan:
    """The plan ``path`` holds, if it was made for ``root``'s parameters, this batch's input shapes
    (or larger ones) and this budget; ``PlanFileMismatch`` saying which differs otherwise."""
    loaded = Plan.load(path)
    wanted = parse_budget(budget, loaded.reference_peak or 1)
    if loaded.asked is not None:  # a pipeline stage's: its budget is one microbatch's share of the one asked
        made_for = parse_budget(loaded.asked, loaded.reference_peak or 1)
        if wanted != made_for:
            raise PlanFileMismatch(f"it was made for --budget {loaded.asked}, this run asks for {budget}; delete the "
                                   "file to plan again")
    elif wanted != loaded.budget:
        raise PlanFileMismatch(f"it was made for a budget of {format_bytes(loaded.budget)} ({loaded.budget} bytes), "
                               f"this run asks for {format_bytes(wanted)}; delete the file to plan again")
    names = dict(root.named_modules())
    missing = [name for name in loaded.blocks if name not in names and not name.startswith("region")]
    blocks = [(name, names.get(name, root)) for name in loaded.blocks]
    if missing or model_signature(root, blocks) != loaded.profile.signature:
        raise PlanFileMismatch(f"it was made for another model (signature {loaded.profile.signature}); delete the "
                               "file to plan again")
    planned = loaded.profile.inputs
    if planned and (len(planned) != len(shapes) or any(len(a) != len(b) or any(x > y for x, y in zip(a, b))
                                                         for a, b in zip(shapes, planned))):
        raise PlanFileMismatch(f"it was made for inputs of shapes {planned}, this step's are {shapes}; delete the "
                               "file to plan again")
    return loaded
