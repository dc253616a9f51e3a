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
- ``torch.distributed.pipelining``: a ``PipelineStage`` run by ``Schedule1F1B`` (its warm-up runs
  ``min(n_microbatches, num_stages - stage_index)`` forwards before the first backward: that many
  alive) or ``ScheduleGPipe`` (every microbatch's forward before any backward: all alive); the
  stage module is the stage's ``submod``. Other schedules (interleaved, zero bubble, several stages
  per rank) are refused by name: ``UnplannedPipeline``.
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


class UnplannedPipeline(ValueError):
    """A pipeline schedule whose microbatches alive at once are not counted yet."""


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
        elif owner is not None and "torch.distributed.pipelining.stage._PipelineStageBase" in _class_names(owner):
            return _torch_stage(owner, calls, frame)
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


def _torch_stage(stage: Any, calls: list[types.FrameType], frame: types.FrameType) -> PipelineStage | None:
    call = _module_call(stage.submod, calls)
    if call is None:
        return None
    schedule = None
    outer: types.FrameType | None = frame
    while outer is not None and schedule is None:
        owner = outer.f_locals.get("self")
        if owner is not None and "torch.distributed.pipelining.schedules._PipelineSchedule" in _class_names(owner):
            schedule = owner
        outer = outer.f_back
    name = type(schedule).__name__ if schedule is not None else "no schedule"
    stages, index = int(stage.num_stages), int(stage.stage_index)
    microbatches = int(getattr(schedule, "_n_microbatches", 0) or 0)
    if name == "Schedule1F1B":
        alive = min(microbatches, stages - index)
    elif name == "ScheduleGPipe":
        alive = microbatches
    else:
        raise UnplannedPipeline(f"torch.distributed.pipelining stage {index} of {stages} run by {name}: acshim run "
                                "--budget counts the microbatches alive at once for Schedule1F1B and ScheduleGPipe "
                                "only; use one of them, or drop --budget")
    return PipelineStage("torch.distributed.pipelining", name.removeprefix("Schedule"), stage.submod, *call,
                         stage=index, stages=stages, microbatches=microbatches, in_flight=max(1, alive))
