"""The regions of a step and the model they run in, found from the call stack (the script is not
changed, so nothing tells the planner which module is the model; which API made a region call its
facade says, ``acshim.region_dialect``)."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import structures
from ..options import RegionOptions

_WRAPPERS = ("DistributedDataParallel", "DataParallel", "DeepSpeedEngine", "FullyShardedDataParallel",
             "DistributedModel", "PipelineModule")


@dataclass
class RegionSite:
    """Region i of the step: the callable the script checkpointed and what it asked for, and what
    profiling learned about it."""

    function: Callable[..., Any]
    owner: nn.Module | None
    dialect: str
    asked: str
    name: str = ""
    captured: tuple[Any, Any, list[bool]] | None = None
    """Copies of its inputs (the first region of each distinct kind only), with their grad flags."""
    key: Any = None
    """What identical regions share (code, owner class, parameter and input shapes)."""
    spec: Any = None
    """The shapes of its output (``replay.spec_of``), replayed while the rest of the model is measured."""
    saved: int = 0
    """Bytes its forward saves for backward without checkpointing (counted, never held)."""
    forward_seconds: float = 0.0
    options: RegionOptions | None = None
    choice: str | None = None
    calls: int = 0
    asked_options: RegionOptions | None = None
    """The options the script's call gave the region (its ``context_fn`` and all)."""
    as_asked: bool = False
    """Its ``context_fn``'s policy offloads (``selective.OffloadProbe`` on the counting forward): it runs
    with ``asked_options`` on every step (``choices.ASKED``), not as a choice of the plan."""


_CALL_CODES = {nn.Module._call_impl.__code__, getattr(nn.Module, "_wrapped_call_impl", nn.Module._call_impl).__code__}


def _module_calls() -> list[types.FrameType]:
    """The frames of this thread's ``nn.Module`` calls, innermost first."""
    frame: types.FrameType | None = sys._getframe(2)
    calls = []
    while frame is not None:
        if frame.f_code in _CALL_CODES and isinstance(frame.f_locals.get("self"), nn.Module):
            calls.append(frame)
        frame = frame.f_back
    return calls


def model_on_stack() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]] | None:
    """The outermost ``nn.Module`` call on this thread's stack that is not a data-parallel wrapper,
    with the arguments it was called with."""
    for frame in reversed(_module_calls()):
        module = frame.f_locals["self"]
        if type(module).__name__ not in _WRAPPERS:
            return module, tuple(frame.f_locals.get("args", ())), dict(frame.f_locals.get("kwargs", {}))
    return None


def outermost_module_on_stack() -> nn.Module | None:
    """The outermost ``nn.Module`` call on this thread's stack, wrappers included (a DeepSpeed
    engine, FSDP, DDP): where a training step's forward starts as the script sees it."""
    calls = _module_calls()
    return calls[-1].f_locals["self"] if calls else None


def describe(options: RegionOptions) -> str:
    if options.context_fn is not None:
        return "selective"
    kind = "reentrant recompute" if options.reentrant else "recompute"
    return kind + (" + offload" if options.saved_tensors_scope is not None else "")


def site_names(root: nn.Module, sites: list[RegionSite]) -> list[str]:
    names = {id(module): name for name, module in root.named_modules()}
    out = []
    for index, site in enumerate(sites):
        name = names.get(id(site.owner)) if site.owner is not None else None
        out.append(name if name else f"region{index}:{getattr(site.function, '__qualname__', 'fn')}"[:40])
    return out


def device_of(module: nn.Module) -> torch.device:
    return next((parameter.device for parameter in module.parameters()), torch.device("cpu"))  # allocates nothing


def sharded_by(root: nn.Module | None) -> str | None:
    """The sharding wrapper around or inside the model being run (FSDP1, FSDP2, a DeepSpeed engine:
    ZeRO's hooks run collectives per parameter), None for a replicated model."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        module = frame.f_locals.get("self") if frame.f_code in _CALL_CODES else None
        if type(module).__name__ in ("FullyShardedDataParallel", "DeepSpeedEngine", "PipelineModule"):
            return type(module).__name__
        frame = frame.f_back
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        FSDPModule = ()
    for module in root.modules() if root is not None else ():
        if isinstance(module, FSDPModule):
            return "fully_shard (FSDP2)"
        if type(module).__name__ == "FullyShardedDataParallel":
            return "FullyShardedDataParallel"
    return None


def input_elements(args: Any, kwargs: Any) -> int:
    """Elements of the tensors a model call got: what activation memory scales with."""
    leaves, _ = structures.flatten((args, kwargs))
    return sum(leaf.numel() for leaf in leaves if isinstance(leaf, torch.Tensor))


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """Ranks of an initialized default process group, else 1."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
