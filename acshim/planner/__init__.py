"""Memory-budget planner: per block, keep / selective / recompute / offload, chosen by measurement
so a training step's peak activation memory fits a budget at the least predicted step time.

>>> plan = acshim.plan(model, batch, budget="1.5GiB")
>>> print(plan); plan.apply(model)
"""

from __future__ import annotations

from .api import plan
from .budget import parse_budget
from .choices import BASE_CHOICES
from .plan import FrontierPoint, NoPlanMeasured, Plan, PlanFileMismatch
from .profile import measure_step
from .solver import BudgetTooSmall

__all__ = ["BASE_CHOICES", "BudgetTooSmall", "FrontierPoint", "NoPlanMeasured", "Plan", "PlanFileMismatch",
           "measure_step", "parse_budget", "plan"]
