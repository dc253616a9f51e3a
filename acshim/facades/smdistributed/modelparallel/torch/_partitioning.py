"""Which pipeline partition each module of an ``smp.DistributedModel`` lives on (SMP v1 partitioning).

Two ways, as in SMP v1 (``auto_partition`` in the config):

- **manual** (``auto_partition: False``): modules created inside ``with smp.partition(i)`` or given
  to ``smp.set_partition(module, i)`` are on partition ``i``; a module placed neither way is on its
  parent's partition, and the root on ``default_partition``.
- **automatic** (the default): at the first ``smp.step`` the first microbatch's forward is traced
  once on global rank 0 (RNG state and buffers restored afterwards, so training is unchanged), which
  measures each module's parameter bytes and the bytes of the activations autograd saves inside it.
  The module tree is opened from the root until its pieces ("units", in call order) are small
  enough, then cut into ``pp`` consecutive runs minimising the largest run's memory (parameters plus
  saved activations: the memory SMP's auto partition balanced). A child of an ``nn.Sequential`` is
  never opened: it lies whole on one partition. An opened module runs on the partition of its first
  called child. The decision is sent from rank 0 to every rank.

Either way the assignments are logged once, on global rank 0, on a line starting
``Partition assignments:``. The result is one partition index per module of
``root.modules()`` (duplicates removed), the same on every rank.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from acshim.region import ROUTERS

LOGGER = logging.getLogger("smdistributed.modelparallel")


def _logger() -> logging.Logger:
    """SMP's logger prints its INFO lines without any logging setup in the script; so does this one."""
    if not LOGGER.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[smp] %(message)s"))
        LOGGER.addHandler(handler)
        LOGGER.setLevel(logging.INFO)
        LOGGER.propagate = False
    return LOGGER


def module_list(root: nn.Module) -> list[nn.Module]:
    """The modules of ``root`` in ``modules()`` order, each once: the index space of an assignment."""
    return list(root.modules())


def parents_of(root: nn.Module) -> dict[nn.Module, nn.Module]:
    """Each module's first parent (None-free: the root has no entry)."""
    parents: dict[nn.Module, nn.Module] = {}
    for module in root.modules():
        for child in module.children():
            parents.setdefault(child, module)
    return parents


def subtree(module: nn.Module) -> Iterator[nn.Module]:
    yield from module.modules()


# -- manual -----------------------------------------------------------------------------------------

def manual_assignment(root: nn.Module, placed: Mapping[nn.Module, int], default_partition: int) -> list[int]:
    """Partitions from ``smp.partition`` / ``smp.set_partition``; unplaced modules follow their parent."""
    result: dict[nn.Module, int] = {}

    def visit(module: nn.Module, inherited: int) -> None:
        if module in result:
            return
        result[module] = placed.get(module, inherited)
        for child in module.children():
            visit(child, result[module])

    visit(root, default_partition)
    return [result[m] for m in module_list(root)]


# -- automatic --------------------------------------------------------------------------------------

class TraceCosts:
    """Per module: its own parameter bytes, the activation bytes saved while it (not a child) ran,
    and the position of its first call."""

    def __init__(self) -> None:
        self.params: dict[nn.Module, int] = {}
        self.activations: dict[nn.Module, int] = {}
        self.order: dict[nn.Module, int] = {}

    def own(self, module: nn.Module) -> int:
        return self.params.get(module, 0) + self.activations.get(module, 0)


def measure(root: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> TraceCosts:
    """Run ``root(*args, **kwargs)`` once with autograd on and count what each module saves.

    The RNG state and every buffer are put back afterwards and the graph is dropped, so the run
    that follows is the one a script without this trace would make.
    """
    costs = TraceCosts()
    seen: set[int] = set()
    param_ids: set[int] = set()
    for module in root.modules():
        own = 0
        for parameter in module.parameters(recurse=False):
            param_ids.add(id(parameter))
            if id(parameter) not in seen:
                seen.add(id(parameter))
                own += parameter.numel() * parameter.element_size()
        costs.params[module] = own
    stack: list[nn.Module] = []

    def before(module: nn.Module, *_: Any) -> None:
        costs.order.setdefault(module, len(costs.order))
        stack.append(module)

    def after(module: nn.Module, *_: Any) -> None:
        if stack and stack[-1] is module:
            stack.pop()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if stack and id(tensor) not in param_ids:
            owner = stack[-1]
            costs.activations[owner] = costs.activations.get(owner, 0) + tensor.numel() * tensor.element_size()
        return None  # counted, not kept: the trace holds no whole model's activations (the graph is dropped unused)

    handles = []
    for module in root.modules():
        handles.append(module.register_forward_pre_hook(before))
        handles.append(module.register_forward_hook(after))
    rng = torch.get_rng_state()
    buffers = [(b, b.detach().clone()) for b in root.buffers()]
    routers = list(ROUTERS)  # a budget planner plans each stage once partitioned, not this trace
    ROUTERS.clear()
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, _never_unpacked):
            root(*args, **kwargs)
    finally:
        ROUTERS.extend(routers)
        for handle in handles:
            handle.remove()
        torch.set_rng_state(rng)
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
    return costs


def _never_unpacked(_: None) -> torch.Tensor:
    raise RuntimeError("the partitioning trace's graph is never run backward")


def _split_evenly(costs: list[int], stages: int) -> list[int]:
    """Stage of each item: consecutive runs minimising the largest run's sum (linear partition)."""
    n = len(costs)
    prefix = [0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    infinity = float("inf")
    # best[k][i]: the smallest largest-run over the first i items cut into k runs
    best = [[infinity] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(n + 1):
            for j in range(i + 1):
                if best[k - 1][j] == infinity:
                    continue
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value <= best[k][i]:  # on a tie the later cut: empty stages come last
                    best[k][i], cut[k][i] = value, j
    stage_of = [0] * n
    i = n
    for k in range(stages, 0, -1):
        j = cut[k][i]
        for item in range(j, i):
            stage_of[item] = k - 1
        i = j
    return stage_of


def auto_assignment(root: nn.Module, stages: int, costs: TraceCosts) -> list[int]:
    """Cut the called module tree into ``stages`` consecutive runs of balanced memory."""
    parents = parents_of(root)
    totals: dict[nn.Module, int] = {}

    def total(module: nn.Module) -> int:
        if module not in totals:
            totals[module] = costs.own(module) + sum(total(c) for c in module.children())
        return totals[module]

    def called_children(module: nn.Module) -> list[nn.Module]:
        return sorted((c for c in module.children() if c in costs.order), key=costs.order.__getitem__)

    def openable(module: nn.Module) -> bool:
        return bool(called_children(module)) and not isinstance(parents.get(module), nn.Sequential)

    target = total(root) / stages
    units, opened = [root], []
    while True:
        candidates = [u for u in units if openable(u) and (len(units) < stages or total(u) > target)]
        if not candidates:
            break
        largest = max(candidates, key=total)
        at = units.index(largest)
        units[at:at + 1] = called_children(largest)
        opened.append(largest)
    unit_stage = dict(zip(units, _split_evenly([total(u) for u in units], stages)))
    result: dict[nn.Module, int] = {}

    def place(module: nn.Module, stage: int) -> None:
        for member in module.modules():
            result.setdefault(member, stage)

    for unit, stage in unit_stage.items():
        place(unit, stage)

    def stage_of_opened(module: nn.Module) -> int:
        if module in unit_stage:
            return unit_stage[module]
        return stage_of_opened(called_children(module)[0])

    for module in opened:
        result[module] = stage_of_opened(module)
    for module in opened:  # children never called in the trace stay with their parent
        for child in module.children():
            if child not in result:
                place(child, result[module])
    return [result.get(m, 0) for m in module_list(root)]


def log_assignments(root: nn.Module, partitions: list[int]) -> None:
    """One INFO line on global rank 0: ``Partition assignments: name: partition, ...``."""
    names = {}
    for name, module in root.named_modules():
        names.setdefault(module, name or "main")
    shown = ", ".join(f"{names[m]}: {p}" for m, p in zip(module_list(root), partitions))
    _logger().info("Partition assignments: %s", shown)


__all__ = ["TraceCosts", "auto_assignment", "log_assignments", "manual_assignment", "measure", "module_list",
           "parents_of", "subtree"]
