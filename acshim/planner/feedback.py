"""After planning: time the plan's first steps, and solve again with the measured costs when it is
measurably slower than predicted.

A plan's prediction comes from each region measured alone. Offloading can cost more inside the
model than alone (the copies of several regions share one link and the cores; a storage tier that
slows down, a machine that gets busier): the waits show up as prefetch waits in backward and as
regions slower than predicted. ``StepTimer`` times each region of the first ``STEPS`` steps after a
plan (forward: the call; backward: from the gradient reaching its output to its input's gradient),
divides by the prediction, and takes the median over the computing regions as the machine's speed
now. Offloading regions slower than that by more than ``TOLERANCE`` (or prefetch waits above it)
make their choice's predicted seconds the measured ones, scaled for every block, and the session
solves again at the next step's start (``PlanSession.resolve``: the new plan is verified within the
budget before it runs). At most ``MAX_RESOLVES`` times, each said on stderr.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from .. import structures
from .choices import moves_data
from .profile import Profile
from .routing import PlanningContext

STEPS = 2
"""Steps timed after a plan (the step it was made in is not: it began before the plan)."""
TOLERANCE = 0.10
MAX_RESOLVES = 2


class StepTimer:
    """Per-region timing of the steps after a plan (see the module docstring)."""

    def __init__(self, session: PlanningContext) -> None:
        self.session = session
        self.steps: list[dict[int, list[float]]] = []
        self.current: dict[int, list[float]] | None = None
        self.waits: list[float] = []
        self._waited = 0.0
        self.resolves = 0
        self.pending: tuple[Profile, str] | None = None
        self.args: tuple[Any, ...] = ()
        self.kwargs: dict[str, Any] = {}
        self.done = False

    def stop(self) -> None:
        self.done = True
        self.current = None

    # ---------------------------------------------------------------------------------- steps
    def step_started(self, module: Any = None, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
                     ) -> None:
        """At the model's forward pre-hook: close the previous step, decide, re-solve if due."""
        if self.done:
            return
        if self.current is not None:
            self.steps.append(self.current)
            self.waits.append(self._wait_seconds() - self._waited)
            self.current = None
            if len(self.steps) >= STEPS:
                self.pending = self.decide()
                self.steps, self.waits = [], []
                if self.pending is None:
                    self.done = True
                    return
        if self.pending is not None:
            profile, why = self.pending
            self.pending = None
            self.args, self.kwargs = args, dict(kwargs or {})
            try:
                changed = self.session.resolve(profile, why)
            finally:
                self.args, self.kwargs = (), {}
            self.resolves += 1
            if not changed or self.resolves >= MAX_RESOLVES:
                self.done = True
                return
        self._waited = self._wait_seconds()
        self.current = {}

    def region(self, index: int, run: Callable[[], Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run region ``index`` (``run``), timing its forward and, through hooks, its backward."""
        current = self.current
        if current is None or self.done:
            return run()
        start = time.perf_counter()
        output = run()
        record = current.setdefault(index, [0.0, 0.0, 0.0])
        record[0] += time.perf_counter() - start
        first_in = _first_grad_leaf((args, kwargs))
        first_out = _first_grad_leaf(output)
        if first_in is not None and first_out is not None:
            first_out.register_hook(lambda grad, r=record: r.__setitem__(2, time.perf_counter()))
            first_in.register_hook(lambda grad, r=record: r.__setitem__(1, r[1] + time.perf_counter() - r[2]))
        return output

    def _wait_seconds(self) -> float:
        return self.session.offload_wait_seconds()

    # ---------------------------------------------------------------------------------- decide
    def decide(self) -> tuple[Profile, str] | None:
        """A profile with measured costs and the reason, when the plan is measurably slower than
        predicted in a way another plan could avoid; None otherwise."""
        plan = self.session.plan
        if plan is None:
            return None
        ratios: dict[int, float] = {}
        for index, choice in enumerate(plan.choices):
            measured = [step[index][0] + step[index][1] for step in self.steps if index in step and step[index][1] > 0]
            predicted = plan.profile.blocks[index].seconds.get(choice, 0.0) if index < len(plan.profile.blocks) else 0
            if measured and predicted > 0:
                ratios[index] = statistics.median(measured) / predicted
        # a region run as the script asked moves data but is no choice of the plan: neither scale
        computing = [r for i, r in ratios.items() if not moves_data(plan.choices[i])]
        offloading = {i: r for i, r in ratios.items() if "offload" in plan.choices[i]}
        if not offloading and plan.outside == "keep":
            return None  # compute costs scale together: another plan would be no faster
        speed = statistics.median(computing) if computing else 1.0
        step_seconds = plan.seconds or 1.0
        waited = statistics.median(self.waits) if self.waits else 0.0
        excess = {c: statistics.median([r / speed for i, r in offloading.items() if plan.choices[i] == c])
                  for c in {plan.choices[i] for i in offloading}}
        slow = {c: e for c, e in excess.items() if e > 1 + TOLERANCE}
        if not slow and waited <= TOLERANCE * step_seconds * speed:
            return None
        if not slow:  # waits with no region measurably slow: charge them to the offloaded regions
            count = max(1, len(offloading))
            slow = {c: 1 + waited / count / max(1e-9, statistics.median(
                [plan.profile.blocks[i].seconds[c] for i in offloading if plan.choices[i] == c]) * speed)
                    for c in excess}
        blocks = []
        for block in plan.profile.blocks:
            seconds = dict(block.seconds)
            for choice, factor in slow.items():
                if choice in seconds:
                    seconds[choice] *= factor
            blocks.append(replace(block, seconds=seconds))
        outside = dict(plan.profile.outside)
        if plan.outside in outside and waited > TOLERANCE * step_seconds * speed:
            outside[plan.outside] = {**outside[plan.outside],
                                     "seconds": float(outside[plan.outside]["seconds"]) + waited / speed}
            slow.setdefault(plan.outside, 1.0)
        profile = replace(plan.profile, blocks=blocks, outside=outside)
        what = ", ".join(f"{c} {f:.2f}x" for c, f in sorted(slow.items()))
        why = (f"the plan's offloaded regions ran slower than predicted ({what} of the computing regions' "
               f"speed; prefetch waits {waited * 1e3:.0f} ms a step)")
        return profile, why


def _first_grad_leaf(value: Any) -> torch.Tensor | None:
    for leaf in structures.flatten(value)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad and leaf.is_floating_point():
            return leaf
    return None
