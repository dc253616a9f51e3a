"""torchtitan facade: ``MemoryBudgetAC`` (torchtitan 0.3, ``torchtitan.distributed.activation_checkpoint``)
honoured in eager mode by acshim's planner.

Upstream's ``MemoryBudgetAC.apply`` only sets ``torch._functorch.config.activation_memory_budget``,
which the compiler's partitioner reads: in eager mode it does nothing. Under ``acshim.install()`` /
``acshim run`` with torchtitan installed, ``apply`` is replaced in place: every block of
``model.layers`` becomes a region and the planner chooses per block (keep / selective / recompute /
offload) within the budget as torch means it (see ``acshim.planner.budget.BetweenBudget``).
``FullAC`` and ``SelectiveAC`` call torch's ``checkpoint_wrapper``, which acshim's ``torch`` dialect
serves; their ``apply`` (the base class's) runs as upstream's, only naming torchtitan as the API
that built those wrappers (``acshim run --report``). Nothing is served when torchtitan is absent.
"""

from __future__ import annotations

__version__ = "0.3.0+acshim"
"""The torchtitan API level this facade mirrors."""

ACSHIM_PATCHES: list[tuple[str, str, str]] = [
    ("torchtitan.distributed.activation_checkpoint", "MemoryBudgetAC.apply",
     "acshim.facades.torchtitan.distributed.activation_checkpoint.memory_budget_apply"),
    ("torchtitan.distributed.activation_checkpoint", "ActivationCheckpointing.apply",
     "acshim.facades.torchtitan.distributed.activation_checkpoint.policy_apply"),
]

__all__ = ["ACSHIM_PATCHES"]
