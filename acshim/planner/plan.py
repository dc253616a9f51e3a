"""``acshim.plan``: profile, solve, verify; and the ``Plan`` it returns."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from ..blocks import find_blocks
from .aliases import parameters_aliased
from .budget import format_bytes, parse_budget
from .choices import BASE_CHOICES, SharedOffload, expand_choices, install, install_outside, is_offload
from .profile import ModelState, Profile, measure_step, model_signature, profile_model
from .snapshot import ModelSnapshot
from .solver import BudgetTooSmall, Solution, minimum_peak, rounded_peak, solve, unit_of

FORMAT = "acshim-plan/1"


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
    measured_held: int | None = None
    reference_peak: int = 0
    reference_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    outside: str = "keep"
    """The choice for the part of the model outside the blocks (embeddings, head, loss inside the
    forward): ``keep`` or ``offload:TIER``, through the offloaded blocks' schedule."""

    # -------------------------------------------------------------------------------- apply
    def apply(self, model: nn.Module) -> list[str]:
        """Install the plan on ``model`` in place; returns the names of the blocks made regions. A
        model other than the one planned for raises ``ValueError`` and is left untouched."""
        blocks = self._blocks_of(model)
        shared: dict[str, SharedOffload] = {}  # the offloaded blocks share one schedule per tier
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
        data.pop("format")
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
        rows.append(f"predicted: held {format_bytes(self.held)}, peak {format_bytes(self.peak)} "
                    f"({self.peak / ref_peak:.2f}x no checkpointing), step {self.seconds * 1e3:.1f} ms "
                    f"({self.seconds / ref_seconds:.2f}x)")
        if self.measured_peak is not None:
            rows.append(f"measured after apply: held {format_bytes(self.measured_held or 0)}, "
                        f"peak {format_bytes(self.measured_peak)}")
        rows.append(f"profile: {self.profile.method}")
        rows += [f"note: {note}" for note in self.notes]
        return "\n".join(rows)

    def frontier(self, budgets: Iterable[int | float | str] | None = None) -> list[FrontierPoint]:
        """Predicted (peak, step time) of the best plan at each budget (default: 10 budgets from the
        least achievable peak to no checkpointing's), from this plan's profile."""
        low = minimum_peak(self.profile)
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


def _reference(profile: Profile) -> tuple[int, float]:
    keep = ["keep"] * len(profile.blocks)
    if all("keep" in b.held for b in profile.blocks):
        return rounded_peak(profile, keep), profile.seconds_of(keep)
    return 0, 0.0


def plan(model: nn.Module, example_batch: Any, budget: int | float | str, *,
         loss_fn: Callable[[Any], torch.Tensor] | None = None, choices: Sequence[str] = BASE_CHOICES,
         storage: str | Sequence[str] | None = None, prefetch: int = 2, repeats: int = 2, verify: bool = True,
         retries: int = 4, reuse: Plan | None = None) -> Plan:
    """Choose, per block of ``model``, between keeping, selective recompute, full recompute and
    offload so that one training step on ``example_batch`` peaks at most ``budget`` bytes of
    activation memory, as fast as the measurements predict.

    ``budget``: bytes, a size string ("1.5GiB") or a fraction in (0, 1] of the step's peak without
    checkpointing (predicted from the per-block profile: the model never runs unchecked).
    ``choices``: a subset of ``keep, selective, selective-alt, recompute, offload, recompute+offload``.
    ``storage``: tier(s) for the offload choices (default ``"disk"`` on CPU, ``"host"`` otherwise).
    With ``verify`` the plan is applied once and measured; a plan measured over budget is re-solved
    under a tighter budget, and never returned over budget. Raises ``ValueError`` for a budget below
    the least achievable peak (naming it) or a model without repeated blocks. The model is left as
    it was (apply the plan with ``plan.apply(model)``). ``reuse``: an earlier plan of this model
    whose profile is solved again for this budget instead of profiling anew.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"acshim.plan needs an nn.Module, got {type(model).__name__}")
    if isinstance(budget, (int, float, str)) and not isinstance(budget, bool):
        parse_budget(budget, 1)  # reject bad budgets before any work
    else:
        raise TypeError(f"budget must be bytes, a size string or a fraction, got {budget!r}")
    if not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be a non-negative int, got {prefetch!r}")
    blocks = find_blocks(model)
    if not blocks:
        raise ValueError(f"acshim.plan: found no repeated blocks in {type(model).__name__} to plan for")
    if storage is None:
        device = next(model.parameters(), torch.empty(0)).device
        tiers: tuple[str, ...] = ("disk",) if device.type == "cpu" else ("host",)
    else:
        tiers = (storage,) if isinstance(storage, str) else tuple(storage)
    concrete = expand_choices(tuple(choices), tiers)
    if "recompute" not in concrete:
        concrete.append("recompute")  # profiling captures inputs under full recompute
    if reuse is not None:
        reuse._blocks_of(model)  # same model, else ValueError
    snapshot = ModelSnapshot(model)  # buffers, module state, RNG: as they were before planning
    with contextlib.ExitStack() as undo:
        undo.callback(snapshot.restore)
        undo.enter_context(parameters_aliased(model))  # hooks on the real parameters never see planning
        if reuse is not None:
            profile = reuse.profile
        else:
            profile = profile_model(model, example_batch, loss_fn=loss_fn, choices=concrete, prefetch=prefetch,
                                    repeats=repeats, blocks=blocks)
        measure = None if not verify else (
            lambda candidate: _verify(model, example_batch, loss_fn, candidate, blocks))
        return solve_within(profile, budget, measure, retries=retries)


def solve_within(profile: Profile, budget: int | float | str,
                 measure: Callable[[Plan], tuple[int, int]] | None, *, retries: int = 4) -> Plan:
    """The fastest plan of ``profile`` under ``budget``; with ``measure`` (a candidate plan ->
    measured ``(held, peak)``) a plan measured over budget is re-solved under a tighter one, and
    never returned over budget. ``BudgetTooSmall`` names the least achievable peak. When the
    re-solves run out and offload was among the choices, the choices that offload nothing are
    solved once more: copies still in flight to a slow tier (a loaded machine) can keep an
    offloading plan over budget however it is tightened, while recompute's memory does not vary."""
    try:
        return _solve_within(profile, budget, measure, retries)
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
            result = _solve_within(restricted, budget, measure, retries)
        except ValueError:
            raise error from None
        result.notes.append(f"offloading plans stayed over budget when measured ({error}); solved again without "
                            "offload (copies in flight to a slow tier add to the peak on a loaded machine)")
        return result


def _solve_within(profile: Profile, budget: int | float | str,
                  measure: Callable[[Plan], tuple[int, int]] | None, retries: int) -> Plan:
    reference_peak, reference_seconds = _reference(profile)
    budget_bytes = parse_budget(budget, reference_peak or profile.recompute_step["peak"])
    notes = []
    if reference_peak == 0:
        notes.append("'keep' not among the choices: ratios are not shown")
    target = budget_bytes
    for _ in range(retries + 1):
        try:
            found: Solution = solve(profile, target)
        except BudgetTooSmall as error:
            if target == budget_bytes:
                raise BudgetTooSmall(budget_bytes, error.minimum) from None
            raise ValueError(f"no plan measured within the budget {format_bytes(budget_bytes)}: predictions were "
                             f"low by up to {format_bytes(budget_bytes - target)} and the tightened budget is below "
                             f"the least achievable peak {format_bytes(error.minimum)}") from None
        result = Plan(budget_bytes, [b.name for b in profile.blocks], found.choices, found.held, found.peak,
                      found.seconds, profile, reference_peak=reference_peak, reference_seconds=reference_seconds,
                      notes=list(notes), outside=found.outside)
        if measure is None:
            return result
        held, peak = measure(result)
        result.measured_held, result.measured_peak = held, peak
        if peak <= budget_bytes:
            if target != budget_bytes:
                result.notes.append(f"re-solved under {format_bytes(target)}: an earlier plan measured over budget")
            return result
        target -= peak - budget_bytes + unit_of(profile)
    raise ValueError(f"no plan measured within the budget {format_bytes(budget_bytes)} after {retries} re-solves")


def _verify(model: nn.Module, batch: Any, loss_fn: Callable[[Any], torch.Tensor] | None, result: Plan,
            blocks: list[tuple[str, nn.Module]]) -> tuple[int, int]:
    state = ModelState(model, blocks)
    model.train()
    try:
        result.apply(model)
        model.zero_grad(set_to_none=True)
        return measure_step(model, batch, loss_fn)
    finally:
        state.restore()
