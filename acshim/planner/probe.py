"""After a plan is verified: try the plan that offloading would give if its copies were free, on one
measured step, and take it where that step is measurably faster.

Offloading's predicted time is the busy machine's (``costs.py``: a block measured alone is charged
its copies' processor time on other threads, its backward's prefetch waits and its operators'
slowdown beside its copies), which is what a step of offloaded blocks costs on some machines and
well above it on others: on this project's 2-core AVX-512 Xeon (2026-11-30, HF GPT-2 8x512) the
same step with every block on disk ran at 1.02x and at 1.48x of no checkpointing a few hours apart
(a virtual disk whose speed varies), while the profile priced an offloaded block at 1.4-1.7x of
keeping it both times. No price set from a block alone fits both, and a plan that never offloads
never learns that offloading would have been faster (``feedback`` times only what a plan runs).

So the verified plan (where it was the first solved: after re-solves the predictions ran low, and a
plan solved at the first target may well be over too) is compared with a measured alternative: the
profile is solved again with each
offload choice priced as its computing counterpart (``offload`` as ``keep``, ``recompute+offload``
as ``recompute``: the least it can cost), and where that plan offloads and is predicted at least
``PROBE_GAIN`` faster than the verified one, it is verified too (one more step, within the same
budget and guard). It is taken only when that step ran at least ``PROBE_MARGIN`` faster than the
verified plan's own step (both measured the same way, one after the other, the guard's own time left
out). The margin covers what a verification step carries and a steady step does not: here they ran
1.3-1.4x the steady steps (the heap trimmed before each, its pages faulted back), more for plans
that keep more resident, so at 0.47 of HF GPT-2 8x512 the offloading plan measured 5% faster than
the recompute/selective one in verification where their steady steps ran alike (1.33x and 1.32x of
no checkpointing). Its profile then prices
offloading as measured (``measured_offload``), so later solves on it (``reuse=``, re-plans) agree
with the choice. Otherwise the verified plan stands and its notes say what was tried. The steps
after planning are still timed (``feedback``): an offloading plan that runs slower than measured
here is solved again with the measured costs.

Not yet enabled in the planner's sessions (``solve_within(..., probe=True)`` only): the probe's step
leaves resident what an offloading step pages in and starts (its code, the tier's worker threads:
0.2-0.3 MiB more in every later step of HF Llama 6x384 here), which the plan's charges, read before
it, do not cover; a clean-clone CI run with it enabled had one budget test's third step 1.4% over.
Charging that residue (or re-reading the charges after the probe and re-solving) comes first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from .budget import format_bytes
from .choices import is_offload, split_outside
from .profile import Profile, feasible

if TYPE_CHECKING:
    from .plan import Plan

PROBE_MARGIN = 0.10
"""How much faster (share of the verified plan's measured step) the probe's measured step must be
to be taken: above one step's noise (1-3% idle here) and the verification's bias (module docstring)."""
PROBE_GAIN = PROBE_MARGIN
"""How much faster (share of the verified plan's predicted step) the plan with free copies must be
predicted for a step to be spent measuring it: no less than it would have to measure."""


def computing_counterpart(choice: str) -> str | None:
    """The choice that does the same computing without the copies: ``offload:disk`` -> ``keep``,
    ``recompute+offload:disk`` -> ``recompute``; outside choices ``offload:disk+head`` -> ``head``;
    None for a choice that moves nothing."""
    if is_offload(choice):
        mode = split_outside(choice)[1]
        return mode or "keep"
    if "+offload" in choice:
        return choice.partition("+")[0]
    return None


def copies_free(profile: Profile) -> Profile:
    """``profile`` with every measured offload choice priced as its computing counterpart."""
    blocks = []
    for block in profile.blocks:
        seconds = dict(block.seconds)
        for choice in block.seconds:
            base = computing_counterpart(choice)
            if base is not None and feasible(block, choice) and feasible(block, base):
                seconds[choice] = block.seconds[base]
        blocks.append(replace(block, seconds=seconds))
    outside = {name: dict(entry) for name, entry in profile.outside.items()}
    for name, entry in outside.items():
        base = computing_counterpart(name)
        if base is not None and base in profile.outside_choices() and name in profile.outside_choices():
            entry["seconds"] = profile.other(base)[2]
    return replace(profile, blocks=blocks, outside=outside)


def measured_offload(profile: Profile, plan: Plan, extra: float) -> Profile:
    """``profile`` with the offload choices ``plan`` takes priced at their computing counterpart plus
    a share of ``extra`` seconds by the bytes each part saves (what its copies carry): the cost of
    the copies that the probe's step measured."""
    free = copies_free(profile)
    offloaded = [(i, c) for i, c in enumerate(plan.choices) if computing_counterpart(c) is not None]
    outside_moves = computing_counterpart(plan.outside) is not None
    weights = {i: max(1, profile.blocks[i].saved) for i, _ in offloaded}
    total = sum(weights.values()) + (max(1, profile.other_saved) if outside_moves else 0)
    blocks = list(profile.blocks)
    # every block of the same choice gets the same price per saved byte (identical blocks stay alike)
    for index, choice in offloaded:
        share = extra * weights[index] / total
        seconds = dict(blocks[index].seconds)
        seconds[choice] = free.blocks[index].seconds[choice] + share
        blocks[index] = replace(blocks[index], seconds=seconds)
    outside = {name: dict(entry) for name, entry in profile.outside.items()}
    if outside_moves:
        share = extra * max(1, profile.other_saved) / total
        outside[plan.outside]["seconds"] = free.other(plan.outside)[2] + share
    return replace(profile, blocks=blocks, outside=outside)


def probe_offload(found: Plan, accept: int, measure: Callable[[Plan], Any],
                  solve_unverified: Callable[[Profile], Plan]) -> Plan:
    """``found`` (verified) or, where measured faster, the plan that free copies give (module
    docstring). ``accept``: the most a verification may see (the budget less its headroom);
    ``solve_unverified``: solves a profile within the budget without measuring."""
    if found.verified_seconds is None or found.verified_seconds <= 0:
        return found
    try:
        candidate = solve_unverified(copies_free(found.profile))
    except ValueError:  # nothing fits with these prices: there is nothing to try
        return found
    moves = [c for c in [*candidate.choices, candidate.outside] if computing_counterpart(c) is not None]
    if not moves or (candidate.choices, candidate.outside) == (found.choices, found.outside):
        return found
    if candidate.seconds > found.seconds * (1 - PROBE_GAIN):
        return found
    what = f"{sum(is_offload(c) or '+offload' in c for c in candidate.choices)} blocks offloaded"
    try:
        verified = measure(candidate)
    except OSError as error:  # the tier failed a copy (acshim.storage.OffloadIOError): the plan found needs none
        found.notes.append(f"probed the plan that free copies give ({what}): its copies failed ({error}); "
                           "kept this one")
        return found
    seen = verified.process_peak if verified.process_peak is not None else verified.peak
    if verified.stopped or seen > accept:
        found.notes.append(f"probed the plan that free copies give ({what}): over the budget when measured "
                           f"({'stopped' if verified.stopped else format_bytes(seen)}); kept this one")
        return found
    if verified.seconds > found.verified_seconds * (1 - PROBE_MARGIN):
        found.notes.append(f"probed the plan that free copies give ({what}): its step measured "
                           f"{verified.seconds * 1e3:.0f} ms against this plan's {found.verified_seconds * 1e3:.0f} ms; "
                           "kept this one")
        return found
    # the machine's speed now (the verified plan's step against its prediction) converts the probe's
    # measured step into the profile's terms, so both plans are priced alike
    speed = found.verified_seconds / found.seconds if found.seconds > 0 else 1.0
    extra = max(0.0, verified.seconds / speed - candidate.seconds)
    profile = measured_offload(found.profile, candidate, extra)
    taken = replace(candidate, profile=profile, seconds=profile.seconds_of(candidate.choices, candidate.outside),
                    notes=[*found.notes])
    taken.measured_held, taken.measured_peak = verified.held, verified.peak
    taken.measured_process_peak, taken.verified_seconds = verified.process_peak, verified.seconds
    taken.notes.append(f"offloading priced by a measured step: the plan that free copies give ({what}) measured "
                       f"{verified.seconds * 1e3:.0f} ms against {found.verified_seconds * 1e3:.0f} ms for the plan "
                       f"solved first ({', '.join(found.choices)}), and was taken")
    return taken
