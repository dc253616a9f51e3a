"""``acshim.plan(model, batch, budget)``: the planner driven from Python, one step of the model in
this process (profile, solve, verify), the same session ``acshim run --budget`` uses. Kept apart from
``planner.plan`` (the ``Plan`` it returns), which the session itself imports: no import circle."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..allocator import own
from ..blocks import find_blocks
from .budget import parse_budget
from .choices import BASE_CHOICES, expand_choices, install, install_outside
from .plan import Plan
from .process import check_memory_kind
from .profile import ModelState, run_step
from .session import PlanExit, PlanSession


def plan(model: nn.Module, example_batch: Any, budget: int | float | str, *,
         loss_fn: Callable[[Any], torch.Tensor] | None = None, choices: Sequence[str] = BASE_CHOICES,
         storage: str | Sequence[str] | None = None, prefetch: int = 2, repeats: int = 1, verify: bool = True,
         retries: int = 6, reuse: Plan | None = None, memory: str = "process",
         plan_file: str | os.PathLike[str] | None = None) -> Plan:
    """Choose, per block of ``model``, between keeping, selective recompute, full recompute and
    offload so that one training step on ``example_batch`` peaks at most ``budget`` bytes of
    activation memory, as fast as the measurements predict.

    ``budget``: bytes, a size string ("1.5GiB") or a fraction in (0, 1] of the step's peak without
    checkpointing (predicted from the profile: the model never runs unchecked; its activations' peak
    and what the step holds besides them, as each plan's prediction has them). It is memory the
    process has above what it holds when ``acshim.plan`` is called (parameters, gradients): its
    resident set on CPU, the caching allocator's reserved bytes on a GPU. Planning itself stays
    within it (measurements that would go over it are stopped, their choice left out), and what the
    call loads into the process the first time it runs (torch._dynamo, acshim's extensions: 9 to
    25 MiB measured here, resident from then on) is charged to the plan.
    ``choices``: a subset of ``keep, selective, selective-alt, recompute, offload, recompute+offload``.
    ``storage``: tier(s) for the offload choices (default ``"disk"`` on CPU, ``"host"`` otherwise).
    With ``verify`` the plan is applied once and measured; a plan measured over budget is re-solved
    under a tighter budget, and never returned over budget. Raises ``BudgetTooSmall`` (a
    ``ValueError``) for a budget below the least achievable peak, ``NoPlanMeasured`` (a
    ``ValueError``) where every plan verified, the least one last, measured over it (each naming a
    budget that plans, tested by planning at it where the process's memory is read), or
    ``ValueError`` for a model without repeated blocks. The model is left as it was (apply the plan with
    ``plan.apply(model)``). ``reuse``: an earlier plan of this model whose profile is solved again
    for this budget instead of profiling anew. ``plan_file``: a path, as ``acshim run --budget B
    --plan-file F``: where it holds a plan made for this model (its parameters' names and shapes),
    these input shapes (or larger) and this budget, that plan is returned without profiling; where it
    does not exist, the new plan is saved there. A file made for another model, shapes or budget
    raises ``PlanFileMismatch`` (a ``ValueError``) saying which (delete it to plan again).
    ``repeats`` is accepted for compatibility: every choice is measured once, its time estimated
    operator by operator (``planner.costs``).
    ``memory="tensors"``: the budget counts activation tensor storages only (no guard on the
    process; for models whose activations are below the 1 MiB the process's memory resolves).
    With ``memory="process"`` on glibc, the call fixes the process's ``M_MMAP_THRESHOLD`` at 64 KiB
    (``acshim.allocator.own``; kept where ``MALLOC_MMAP_THRESHOLD_`` is set) so that its resident
    memory follows what tensors hold; set it before the model is built (or call
    ``acshim.allocator.own()`` first) to plan from a heap that already follows it. From the call on,
    torch's CPU allocator is acshim's (``acshim.host_allocator``: a mapping per block of 64 KiB or
    more, freed blocks kept for the steps after the plan, never more than its tensors held at once),
    so that what it measures, and the steps the plan then runs, follow what tensors hold even where
    the heap does not (steps run before the threshold was fixed leave free chunks in it, which later
    tensors reuse and never give back); it stays so where a plan is returned, and is torch's again
    where the call raises (``acshim.host_allocator.uninstall()`` restores torch's). The same call
    sets the CUDA caching allocator's ``expandable_segments`` unless ``PYTORCH_CUDA_ALLOC_CONF`` /
    ``PYTORCH_ALLOC_CONF`` is set, so that reserved memory on a GPU follows what tensors hold.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"acshim.plan needs an nn.Module, got {type(model).__name__}")
    if isinstance(budget, (int, float, str)) and not isinstance(budget, bool):
        parse_budget(budget, 1)  # reject bad budgets before any work
    else:
        raise TypeError(f"budget must be bytes, a size string or a fraction, got {budget!r}")
    if not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be a non-negative int, got {prefetch!r}")
    check_memory_kind(memory)
    if plan_file is not None and not isinstance(plan_file, (str, os.PathLike)):
        raise TypeError(f"plan_file must be a path (str or os.PathLike), got {type(plan_file).__name__}")
    if plan_file is not None and reuse is not None:
        raise ValueError("acshim.plan: pass reuse= (solve an earlier plan's profile again) or plan_file= (load or "
                         "save a plan), not both")
    if memory == "process":
        own()
    blocks = find_blocks(model)
    if not blocks:
        raise ValueError(f"acshim.plan: found no repeated blocks in {type(model).__name__} to plan for")
    tiers = None if storage is None else ((storage,) if isinstance(storage, str) else tuple(storage))
    concrete = list(choices)
    if tiers is not None:
        concrete = expand_choices(tuple(choices), tiers)
    if reuse is not None:
        reuse._blocks_of(model)  # same model, else ValueError
    state = ModelState(model, blocks)  # the blocks' forwards: recompute regions while planning
    session = PlanSession(budget, choices=tuple(concrete), storage=None if tiers is None else tiers[0],
                          prefetch=prefetch, repeats=repeats, exit_after_plan=True, loss_fn=loss_fn, verify=verify,
                          retries=retries, reuse=reuse.profile if reuse is not None else None, api=True,
                          feedback=False, memory=memory,
                          plan_file=None if plan_file is None else os.fspath(plan_file))
    model.train()
    planned = False
    try:
        install_outside(model, "keep")  # a plan applied before offloads the outside part: not while planning
        for _, block in blocks:
            install(block, "recompute")  # each block a region the session routes
        session.start(baseline_now=True)
        try:
            run_step(model, example_batch, loss_fn)
        except PlanExit as done:
            if done.code != 0:
                raise ValueError(done.message) from None
        else:
            raise ValueError(f"acshim.plan: no block of {type(model).__name__} ran with grad enabled")
        planned = True
    finally:
        session.stop(keep_allocator=planned)
        state.restore()
    result = session.plan
    assert result is not None
    if reuse is not None:
        result.blocks = list(reuse.blocks)
    return result
