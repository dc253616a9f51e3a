"""``torchtitan.distributed.activation_checkpoint.MemoryBudgetAC.apply`` (torchtitan 0.3) on acshim's
planner, in eager mode.

Upstream sets ``torch._functorch.config.activation_memory_budget = memory_budget`` (kept here: a
compiled model's partitioner still reads it) and relies on ``torch.compile``; torchtitan's Trainer
refuses the policy without compile. Here each block of ``model.layers`` becomes a region with the
config's ``preserve_rng_state``, ``determinism_check`` and ``debug``, and, unless a plan is already
being made (``acshim run --budget``), a planning session starts: on the first training step it
chooses per block within ``memory_budget`` as torch means it, 0.0 full recompute's activation memory
and 1.0 no checkpointing's (``BetweenBudget``). ``visualize_memory_budget_pareto`` is the
compiler's and stays as upstream sets it.

Not for compiled models yet: the regions reach ``torch.compile`` as torch's checkpoint operator, so
the partitioner no longer weighs those blocks' activations against the budget as it would upstream.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch._functorch.config
from torch import nn

from acshim.options import RegionOptions
from acshim.planner.budget import BetweenBudget
from acshim.region_dialect import made_by
from acshim.wrap import checkpoint_module

__all__ = ["memory_budget_apply"]  # policy_apply is upstream's own apply, named torchtitan in the report

DIALECT = "torchtitan"


def memory_budget_apply(policy: Any, model: nn.Module) -> None:
    """``MemoryBudgetAC.apply(model)``: the budget set for the compiler as upstream, and honoured in
    eager mode by acshim's planner (see the module). ``ValueError`` for a ``memory_budget`` outside
    [0, 1] (upstream's partitioner asserts the same range)."""
    config = policy.config
    budget = BetweenBudget(config.memory_budget)
    # as every torchtitan policy's apply: Dynamo's LRU cache off (SAC + pipeline parallel + flex
    # attention pick the wrong graph otherwise, pytorch/pytorch#166926)
    torch._C._dynamo.eval_frame._set_lru_cache(False)
    if config.visualize_memory_budget_pareto:
        pareto_dir = os.path.join(policy.dump_folder, "memory_budget_pareto")
        os.makedirs(pareto_dir, exist_ok=True)
        torch._functorch.config.memory_budget_pareto_dir = pareto_dir
        torch._functorch.config.visualize_memory_budget_pareto = True
    torch._functorch.config.activation_memory_budget = config.memory_budget
    options = RegionOptions(preserve_rng_state=config.preserve_rng_state,
                            determinism_check=config.determinism_check, debug=config.debug, dialect=DIALECT)
    for _, block in model.get_submodule("layers").named_children():
        checkpoint_module(block, options)
        block.acshim_dialect = DIALECT  # what --report names the region's API
    _plan_within(budget)


def policy_apply(policy: Any, model: nn.Module) -> None:
    """``ActivationCheckpointing.apply(model)`` (the one ``FullAC`` and ``SelectiveAC`` inherit):
    upstream's own, with the ``checkpoint_wrapper`` regions it builds reported as torchtitan's."""
    from torchtitan.distributed.activation_checkpoint import ActivationCheckpointing

    upstream = vars(ActivationCheckpointing)["apply"]
    with made_by(DIALECT):
        getattr(upstream, "__wrapped__", upstream)(policy, model)  # under acshim.install(): the original


def _plan_within(budget: BetweenBudget) -> None:
    from acshim import region
    from acshim.planner.session import PlanSession

    if any(isinstance(router, PlanSession) for router in region.ROUTERS):
        return  # acshim run --budget plans already: its budget is the user's
    with torch.random.fork_rng(devices=[]):  # the planner's warm-up draws nothing from the script's stream
        # torch's budget counts activation memory (what the partitioner saves), not the process's:
        # the planner counts tensor storages too, and the budget is no promise on the process's RSS
        PlanSession(budget, memory="tensors").start()
