"""What a plan says: the one log line ``acshim run --budget`` prints (``plan_line``) and, with
``acshim plan``, the predicted memory vs step-time frontier, the uniform recipes (every region the
same) predicted from the same profile, and a figure of both."""

from __future__ import annotations

from ..selective import offload_tier
from .budget import format_bytes
from .choices import ASKED
from .plan import Plan, reference
from .profile import Profile
from .sites import RegionSite


def plan_outcome(plan: Plan, reused_from: str | None = None) -> str:
    """The whole step's prediction, comparable with the process's measured peak (the activations'
    peak and what the process held besides when the plan was solved: room the solver left for),
    beside the measured peak and their ratio to no checkpointing's."""
    measured = plan.measured_process_peak if plan.measured_process_peak is not None else plan.measured_peak
    ratio = (f" ({measured / plan.reference_peak:.2f}x no checkpointing)"
             if plan.reference_peak and measured is not None else "")
    seen = "process" if plan.measured_process_peak is not None else "tracker"
    predicted = format_bytes(plan.peak + plan.overhead)
    if plan.overhead:
        charged = next((note.removeprefix("charged: ") for note in plan.notes if note.startswith("charged: ")), "")
        predicted += (f" ({format_bytes(plan.peak)} activations + {format_bytes(plan.overhead)} "
                      f"held besides{'; of which charged: ' + charged if charged else ''})")
    tail = (f"predicted peak {predicted}, measured {format_bytes(measured or 0)} ({seen}){ratio}"
            if measured is not None else f"predicted peak {predicted}")
    if reused_from:
        tail += f"; reused from {reused_from} (not profiled again)"
    return tail


def plan_replacing(plan: Plan, sites: list[RegionSite]) -> str:
    """What the plan replaced: the regions, which API asked for them and how, and the ones the
    script's own offload policy runs (``choices.ASKED``)."""
    regions = len(sites) or len(plan.blocks)
    as_asked = plan.choices.count(ASKED)
    replaced = [site for index, site in enumerate(sites) if index >= len(plan.choices) or plan.choices[index] != ASKED]
    what = _asked_by(replaced)
    if not as_asked:
        return f"replaced {regions} region(s) {what}by the plan ({plan.describe()})"
    # the regions the script's offload policy runs are no part of what the plan replaced
    counts = ", ".join(f"{n} {c}" for c, n in _tally(plan.choices).items() if c != ASKED)
    outside = "" if plan.outside == "keep" else f"{'; ' if counts else ''}outside the regions: {plan.outside}"
    replacing = (f"replaced {regions - as_asked} region(s) {what}by the plan ({counts}{outside})"
                 if regions > as_asked else f"replaced no region{f' ({outside})' if outside else ''}")
    kept = [site for site in sites if site not in replaced]
    tiers = sorted({offload_tier(site.asked_options.context_fn) for site in kept if site.asked_options})
    return replacing + (f"; {as_asked} region(s) {_asked_by(kept)}run as the script asked (its offload policy"
                        f"{', to the ' + '/'.join(tiers) + ' tier' if tiers else ''}, on every step)")


def plan_line(plan: Plan, sites: list[RegionSite], brief: bool = False, reused_from: str | None = None) -> str:
    """The one log line of a plan made for ``sites``: what it replaced, its predicted and measured
    peaks (``brief``: the plan's choices and peaks alone)."""
    if brief:
        return f"{plan.describe()}; {plan_outcome(plan, reused_from)}"
    return f"acshim: --budget {format_bytes(plan.budget)}: {plan_replacing(plan, sites)}; {plan_outcome(plan, reused_from)}"


def _tally(choices: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for choice in choices:
        counts[choice] = counts.get(choice, 0) + 1
    return counts


def _asked_by(sites: list[RegionSite]) -> str:
    """``"(2 torch.utils.checkpoint: selective) "``: which API asked for these regions, and what."""
    return f"({', '.join(f'{n} {k}' for k, n in _tally([f'{s.dialect}: {s.asked}' for s in sites]).items())}) " \
        if sites else ""


def frontier_table(plan: Plan) -> str:
    """The predicted memory vs step-time frontier, and uniform recipes beside it (predicted from the
    same block profile: the model never runs without checkpointing)."""
    ref_peak, ref_seconds = plan.reference_peak or 1, plan.reference_seconds or 1.0
    rows = []
    if plan.least_budget:  # above the table: its rows keep their place under the title
        rows.append(f"least budget that plans: {plan.least_budget} bytes ({format_bytes(plan.least_budget)}): the "
                    f"least peak in the frontier below, {format_bytes(plan.overhead)} held besides, the verification's headroom, "
                    "every measurement it needs within the guard, 5% margin")
    rows.append("frontier (predicted from the block profile)")
    rows.append(f"{'budget':>12} {'peak':>12} {'peak x':>7} {'step ms':>9} {'step x':>7}  choices")
    for point in plan.frontier():
        rows.append(f"{format_bytes(point.budget):>12} {format_bytes(point.peak):>12} {point.peak / ref_peak:>7.2f} "
                    f"{point.seconds * 1e3:>9.1f} {point.seconds / ref_seconds:>7.2f}  {_counts(point.choices)}"
                    f"{'' if point.outside == 'keep' else f'; outside {point.outside}'}")
    rows.append("baselines (every region the same, predicted)")
    for label, choice in baselines(plan.profile):
        peak, seconds = baseline_point(plan, choice)
        rows.append(f"{label:>12} {format_bytes(peak):>12} {peak / ref_peak:>7.2f} {seconds * 1e3:>9.1f} "
                    f"{seconds / ref_seconds:>7.2f}  {choice}")
    return "\n".join(rows)


def baselines(profile: Profile) -> list[tuple[str, str]]:
    """The baseline rows of the plan table (and picture): label and the one choice every region takes."""
    wanted = [("none", "keep"), ("recompute", "recompute"), ("selective", "selective")]
    wanted += [("offload", c) for c in profile.choices if c.startswith("offload:")][:1]
    return [(label, choice) for label, choice in wanted if choice in profile.choices]


def baseline_point(plan: Plan, choice: str) -> tuple[int, float]:
    """Predicted (peak, seconds) of every region run as ``choice``; offload offloads the part outside
    the regions too when it was profiled (as one ``acshim.offload()`` around the step would)."""
    if choice == "keep" and ASKED in plan.profile.choices:  # no checkpointing runs no policy either
        return reference(plan.profile)
    assignment = plan.profile.uniform(choice)
    outside = choice if choice in plan.profile.outside else "keep"
    return plan.profile.peak_of(assignment, outside), plan.profile.seconds_of(assignment, outside)


def _counts(choices: list[str]) -> str:
    return ", ".join(f"{n} {c}" for c, n in _tally(choices).items())
