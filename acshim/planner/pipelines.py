"""The pipeline stage a region call runs in, found explicitly from the schedule on the call stack.

On a pipeline every rank runs its own stage's layers, so ``acshim run --budget`` plans each rank
alone (its stage's regions, its own baseline, the same budget; no agreement across ranks) and charges
each microbatch the schedule keeps alive at once on that stage (``in_flight``): the stage is
planned for one microbatch within ``budget / in_flight``. A microbatch's step (forward and
backward) never holds more than its verified peak, and at most ``in_flight`` of them hold their
activations at once, so the stage stays within the budget.

Recognised (the schedules' own objects, never guessed from shapes):
- DeepSpeed's ``PipelineEngine`` (``deepspeed/runtime/pipe/engine.py``): its ``TrainSchedule`` is
  1F1B, and ``TrainSchedule.num_pipe_buffers`` says a stage keeps
  ``min(stages - stage_id, micro_batches)`` forwards alive; the stage module is the engine's
  ``PipelineModule``, whose forward runs only this stage's layers.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import Any

from torch import nn

_CALL_CODES = {nn.Module._call_impl.__code__, getattr(nn.Module, "_wrapped_call_impl", nn.Module._call_impl).__code__}


@dataclass
class PipelineStage:
    """This rank's stage: the module the schedule runs once per microbatch and its call's arguments."""

    library: str
    schedule: str
    module: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    stage: int
    stages: int
    microbatches: int
    in_flight: int
    """Microbatches whose activations the schedule keeps alive at once on this stage."""

    def describe(self) -> str:
        return (f"{self.library} stage {self.stage} of {self.stages}, {self.schedule} schedule, {self.microbatches} "
                f"microbatches: up to {self.in_flight} alive at once")


def _class_names(value: object) -> set[str]:
    return {f"{cls.__module__}.{cls.__qualname__}" for cls in type(value).__mro__}


def pipeline_on_stack() -> PipelineStage | None:
    """The pipeline stage whose schedule made this call, or None outside any pipeline."""
    frame: types.FrameType | None = sys._getframe(1)
    calls: list[types.FrameType] = []
    while frame is not None:
        owner = frame.f_locals.get("self")
        if frame.f_code in _CALL_CODES and isinstance(owner, nn.Module):
            calls.append(frame)
        elif owner is not None and "deepspeed.runtime.pipe.engine.PipelineEngine" in _class_names(owner):
            return _deepspeed_stage(owner, calls)
        frame = frame.f_back
    return None


def _module_call(module: nn.Module, calls: list[types.FrameType]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    for frame in calls:
        if frame.f_locals.get("self") is module:
            return tuple(frame.f_locals.get("args", ())), dict(frame.f_locals.get("kwargs", {}))
    return None


def _deepspeed_stage(engine: Any, calls: list[types.FrameType]) -> PipelineStage | None:
    call = _module_call(engine.module, calls)
    if call is None:  # not inside the stage module's forward (evaluation helpers, a loss): not a stage step
        return None
    stages, stage, microbatches = int(engine.num_stages), int(engine.stage_id), int(engine.micro_batches)
    return PipelineStage("DeepSpeed PipelineEngine", "1F1B", engine.module, *call, stage=stage, stages=stages,
                         microbatches=microbatches, in_flight=max(1, min(stages - stage, microbatches)))
