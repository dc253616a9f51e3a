"""The pipeline stage a region call runs in, found explicitly from the schedule on the call stack.

On a pipeline every rank runs its own stage's layers, so ``acshim run --budget`` plans each rank
alone (its stage's regions, its own baseline, the same budget; no agreement across ranks). The
rank's budget pays first for what the schedule itself holds outside the stage module
(``ScheduleHeld``: receive and gradient buffers, the loaded batch and labels, the forward's copy of
its inputs, the outputs kept for backward, the gradients sent back), computed from the stage's
input and output sizes and the schedule's own counts; the rest is shared by the microbatches the
schedule keeps alive at once on that stage (``in_flight``): the stage is planned for one microbatch
within ``(budget - held) / in_flight``. A microbatch's step (forward and backward) never holds more
than its verified peak, at most ``in_flight`` of them hold their activations at once, and the
schedule holds at most ``held`` besides, so the rank stays within the budget.

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
- SageMaker model parallelism v1 through acshim's facade (``@smp.step``'s ``StepFunction`` runs
  the step on acshim's own stage runner, ``smdistributed/.../torch/_pipeline_runner.py``): the
  step function runs each microbatch's forward and backward before the next, so one microbatch is
  alive at once for ``pipeline: "simple"`` and ``"interleaved"`` alike (the runner's
  ``ALIVE_AT_ONCE``, counted on the serving stage as ``most_alive``). A stage's part is not one
  module call: the driver (pp_rank 0) runs the model's forward, whose calls to modules on other
  stages are replayed from their last answers' shapes while planning (``StageRunner.replaying``),
  and a serving stage runs the calls it served in the last whole microbatch (``ServedCalls``). So
  each stage plans on its second microbatch (``after_first_microbatch``); the first runs every
  region holding least (recomputed, its input offloaded: ``PlanSession._least_options``).
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import Any

import torch
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
    owner: Any = None
    """The schedule's object (DeepSpeed's engine, torch's ``PipelineStage``) its counts are read from."""
    microbatch_key: Any = None
    """Where the stage's region calls are not inside one call of ``module`` (SMP v1): a callable
    naming the microbatch the stage is in, so region positions restart with each."""
    after_first_microbatch: bool = False
    """The stage plans on a microbatch after its first (whose calls it learns shapes from)."""

    def describe(self) -> str:
        return (f"{self.library} stage {self.stage} of {self.stages}, {self.schedule} schedule, {self.microbatches} "
                f"microbatches: up to {self.in_flight} alive at once")

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def held(self, output_bytes: int) -> ScheduleHeld:
        """What the schedule holds outside the stage module at most, for a stage whose output (one
        microbatch's) takes ``output_bytes``."""
        inputs = tensor_bytes((self.args, self.kwargs))
        if self.library.startswith("SageMaker"):
            return _smp_held(self)
        if self.library.startswith("DeepSpeed"):
            return _deepspeed_held(self, inputs, output_bytes)
        return _torch_held(self, inputs, output_bytes)


@dataclass
class ScheduleHeld:
    """Bytes a pipeline schedule holds on a rank besides its stage module's saved activations, by part."""

    parts: list[tuple[str, int]]

    @property
    def total(self) -> int:
        return sum(size for _, size in self.parts)

    def describe(self) -> str:
        from .budget import format_bytes

        return " + ".join(f"{format_bytes(size)} {what}" for what, size in self.parts if size) or "nothing"


def tensor_bytes(value: Any) -> int:
    """Bytes of the distinct tensor storages in a nest of tuples, lists and dicts."""
    from torch.utils._pytree import tree_flatten

    seen: dict[Any, int] = {}
    for leaf in tree_flatten(value)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":
            storage = leaf.untyped_storage()
            seen[(storage.data_ptr(), leaf.device)] = storage.nbytes()
    return sum(seen.values())


def _deepspeed_held(stage: PipelineStage, inputs: int, outputs: int) -> ScheduleHeld:
    """DeepSpeed ``PipelineEngine`` (``deepspeed/runtime/pipe/engine.py``): ``pipe_buffers`` of
    ``num_pipe_buffers`` slots each keep, until the slot is used again, a received (or loaded) input,
    on the last stage its labels, the output and (not on the first stage) the input's gradient sent
    back (measured: 4 tensors a slot on the last stage of the test model stay after its backward);
    a stage not first receives into one more buffer (``pipe_recv_buf``) and copies it into its slot,
    the copy made while the slot still holds its previous input (``_exec_recv_activations``; the
    first stage's ``_exec_load_micro_batch`` alike);
    ``_exec_forward_pass`` runs the module on a clone of the input; the output's gradient is received
    into ``grad_layer``, or on the last stage made by the loss's backward (``mse_loss``'s makes the
    difference and its scaled gradient: two output-sized tensors); ``_exec_load_micro_batch`` reads a whole
    (inputs, labels) batch from the iterator and drops the half this stage does not use."""
    engine = stage.owner
    buffers = len(getattr(engine, "pipe_buffers", {}).get("inputs", ())) or max(2, stage.in_flight)
    labels = 0
    if stage.last and engine is not None:
        labels = max((tensor_bytes(slot) for slot in engine.pipe_buffers.get("labels", ()) if slot is not None),
                     default=0)
    loaded = labels if stage.first else inputs if stage.last else 0  # the batch's other half, dropped
    slot = inputs + labels + outputs + (0 if stage.first else inputs)
    return ScheduleHeld([
        (f"{buffers} buffer slots (input, labels, output, input gradient)", buffers * slot),
        ("receive buffer", 0 if stage.first else inputs),
        ("a slot's next input, made before its last is let go", inputs),
        (f"{stage.in_flight} input copies", stage.in_flight * inputs),
        ("output gradient", 0 if stage.last else outputs),
        ("the loss's backward (its gradient and a temporary)", 2 * outputs if stage.last else 0),
        ("the loaded batch's other half", loaded),
    ])


def _torch_held(stage: PipelineStage, inputs: int, outputs: int) -> ScheduleHeld:
    """``torch.distributed.pipelining`` (``stage.py``): a stage not first has a receive buffer per
    microbatch (``_create_act_recv_info``), each of which keeps its input's gradient until the step
    ends (``clear_runtime_states``); a stage not last has a gradient receive buffer per microbatch
    (``_create_grad_recv_info``); ``fwd_cache`` keeps each alive microbatch's output until its
    backward, and the last stage keeps every microbatch's output (``output_chunks``) and runs the
    loss's backward on it (two output-sized tensors, as for DeepSpeed)."""
    count = stage.microbatches
    return ScheduleHeld([
        (f"{count} receive buffers", 0 if stage.first else count * inputs),
        (f"{count} input gradients", 0 if stage.first else count * inputs),
        (f"{count} gradient receive buffers", 0 if stage.last else count * outputs),
        (f"{stage.in_flight} outputs kept for backward", 0 if stage.last else stage.in_flight * outputs),
        (f"{count} outputs kept for the step", count * outputs if stage.last else 0),
        ("the loss's backward (its gradient and a temporary)", 2 * outputs if stage.last else 0),
    ])


def _smp_held(stage: PipelineStage) -> ScheduleHeld:
    """acshim's SMP v1 stage runner (``_pipeline_runner``): each call to or from another stage
    travels as one message (``_pipeline_transport``): its tensors cloned (``wire_copy``), saved into
    a byte buffer and copied into a tensor to send; received into a tensor, copied into bytes and
    loaded. The largest message of the last microbatch, three times, is held at most besides the
    stage's own part (the arguments, outputs and gradients of calls, which planning runs)."""
    message = int(getattr(stage.owner, "largest_message", 0))
    return ScheduleHeld([("a message's copies while it is sent or received (3 x the largest)", 3 * message)])


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
        elif owner is not None and frame.f_code.co_name == "__call__" and _SMP_STEP in _class_names(owner):
            return _smp_stage(frame, calls)
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
                         microbatches=microbatches, in_flight=max(1, min(stages - stage, microbatches)), owner=engine)


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
                         stage=index, stages=stages, microbatches=microbatches, in_flight=max(1, alive), owner=stage)


_SMP_STEP = "acshim.facades.smdistributed.modelparallel.torch.step.StepFunction"


def _smp_stage(frame: types.FrameType, calls: list[types.FrameType]) -> PipelineStage | None:
    """An ``@smp.step`` function's call on a model split into pipeline stages (see the module docstring)."""
    model = frame.f_locals.get("model")
    runner = getattr(model, "runner", None)
    if runner is None:  # one process, or before the model is partitioned (its trace runs no region)
        return None
    described = runner.budget_stage()  # the facade describes its own stage: no import of it here
    if runner.stage == 0:
        root = model.module
        call = _module_call(root, calls)
        if call is None:
            raise UnplannedPipeline("smp.step on pipeline stage 0: a checkpointed region ran outside the model's "
                                    "forward (in the step function itself), so the stage has no module to plan; "
                                    "checkpoint inside the model, or drop --budget")
        module, args, kwargs = root, *call
    else:
        module, args, kwargs = described["served"], (), {}
    return PipelineStage("SageMaker model parallelism v1", described["schedule"], module, args, kwargs,
                         stage=runner.stage, stages=len(runner.ranks), microbatches=described["microbatches"],
                         in_flight=described["in_flight"], owner=runner, microbatch_key=runner.microbatch_key,
                         after_first_microbatch=True)
