"""What ``acshim plan`` prints beside the plan: the predicted memory vs step-time frontier, the uniform
recipes (every region the same) predicted from the same profile, and a figure of both."""

from __future__ import annotations

from .budget import format_bytes
from .choices import ASKED
from .plan import Plan, reference
from .profile import Profile


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
    counts: dict[str, int] = {}
    for choice in choices:
        counts[choice] = counts.get(choice, 0) + 1
    return ", ".join(f"{n} {c}" for c, n in counts.items())
