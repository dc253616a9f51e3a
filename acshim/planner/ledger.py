"""What the plan in force was charged for, across a run: the figures ``refusal.Charges`` is made of.

A plan is verified on a measurement that cannot see four things a step holds (``refusal.Charges``:
the script's own loss beyond the planning loss's, code paged in, optimizer state to come, what
``acshim.plan`` loaded). Each is charged once when a plan is solved; the ledger keeps what was
charged and what the process held then, so that a later step that starts holding more than the
plan left room for (gradients kept, an optimizer's first state, more code paged in) or a script
whose loss measured other than its allowance has the plan solved again
(``PlanSession._charge_training_state``, ``PlanSession._charge_script_part``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import nn

from .budget import format_bytes
from .plan import HEADROOM, Plan
from .refusal import Charges
from .solver import unit_of
from .training_state import OptimizerWatch, TrainingState, training_state

MAX_STATE_RESOLVES = 2
"""Times a run's plan is solved again for the gradients and optimizer state its steps came to hold
(``ChargeLedger.grown``): once for the gradients a first backward made, once for the state an
optimizer's first step made later (gradient accumulation)."""


@dataclass(frozen=True)
class StateGrowth:
    """A step that starts holding ``grown`` bytes more than when the plan in force was solved: the
    model's training state ``now`` and ``paged`` bytes more code paged in; the plan's whole step
    was ``predicted`` without them."""

    now: TrainingState
    paged: int
    grown: int
    predicted: int

    def why(self) -> str:
        held = [f"holding {self.now.describe()} for the model"] if self.now.total else []
        if self.paged:
            held.append(f"with {format_bytes(self.paged)} more code paged in")
        return (f"this step started {' and '.join(held)}, {format_bytes(self.grown)} more than when the plan was "
                f"solved (a first step makes them; predicted with them: {format_bytes(self.predicted + self.grown)})")


@dataclass
class ChargeLedger:
    """One planning session's charges (see the module docstring)."""

    watch: OptimizerWatch | None = None
    """Notes the optimizers that step while the script runs (``training_state``)."""
    loaded: int = 0
    """What ``acshim.plan``'s warm-up added to the process above what it held before the call
    (``Charges.loaded``); 0 under ``acshim run`` and for a model on a GPU."""
    script_part: int = 0
    """Bytes the script's own loss and its backward need beyond the planning loss's."""
    script_measured: bool = False
    """Whether ``script_part`` was measured; until then it is ``script_loss_allowance``'s charge."""
    foreseen: int = 0
    """Optimizer state charged to the plan in force before its first ``step()`` made it."""
    paged: int = 0
    """Code paged in since the first planned step started, as charged to the plan in force."""
    file_start: int | None = None
    """File-backed pages resident when the first planned step started (``held_now``'s ``"file"``)."""
    state: TrainingState | None = None
    """The model's gradients and optimizer state when the plan in force was solved."""
    state_resolves: int = 0

    def charges(self, paged: int) -> Charges:
        """What a plan solved now is charged, with ``paged`` bytes of code paged in."""
        return Charges(self.script_part, paged, self.foreseen, self.loaded)

    def solved(self, root: nn.Module, paged: int) -> None:
        """A plan was solved with ``paged`` bytes of code charged, holding ``root``'s training state now."""
        self.paged = paged
        self.state = replace(training_state(root, self.watch), foreseen=self.foreseen)

    def script_measured_as(self, extra: int, resolution: int) -> int | None:
        """The planning step measured the script's own part at ``extra`` bytes: the charge it
        replaces where the two differ by more than ``resolution``, else None (nothing to solve again)."""
        charged, self.script_measured = self.script_part, True
        if abs(extra - charged) <= resolution:
            return None
        self.script_part = extra
        return charged

    def grown(self, root: nn.Module, plan: Plan, paged_now: int) -> StateGrowth | None:
        """Whether a step that starts now holds more training state and code than the plan in force
        was solved with, beyond what a measurement resolves and the room its prediction left under
        the budget (counted as a re-solve, at most ``MAX_STATE_RESOLVES``); None where it does not."""
        if self.state is None or self.state_resolves >= MAX_STATE_RESOLVES:
            return None
        now = training_state(root, self.watch)
        paged = max(0, paged_now - self.paged)
        grown = now.total - self.state.total + paged
        predicted = max(plan.peak + plan.overhead, plan.measured_process_peak or 0)
        if grown <= max(unit_of(plan.profile), plan.budget // 100) or predicted + grown <= int(plan.budget * (1 - HEADROOM)):
            return None  # within what a measurement resolves, or within the room the plan left
        self.state_resolves += 1
        return StateGrowth(now, paged, grown, predicted)
