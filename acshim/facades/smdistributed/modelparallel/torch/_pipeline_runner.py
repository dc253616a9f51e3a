"""The pipeline stage runner of the SMP v1 facade: modules on other partitions run on their rank.

Why not ``torch.distributed.pipelining``: its ``PipelineStage`` + ``ScheduleGPipe`` / ``Schedule1F1B``
own the loop (``schedule.step(x, target=...)`` runs forward, loss and backward for every
microbatch), and need the model cut into stage modules with one tensor flowing between them. An
SMP v1 script owns the loop instead: its ``@smp.step`` function calls ``model(...)`` on a
microbatch, computes the loss with any Python it likes and calls ``model.backward(loss)``; modules
anywhere in the tree may sit on another partition and take or return nested values. So this
runner mirrors SMP's own execution model: global rank 0 of each pipeline group (pp_rank 0, "the
driver") runs the step function; when code on one stage calls a module placed on another, the
call's tensors travel to that stage (``_pipeline_transport``), the module runs there with autograd
on, and its output comes back through an autograd Function (``RemoteCall``) whose backward sends
the output gradients to the owner, which runs ``torch.autograd.backward`` on its saved graph and
returns the input gradients. Calls nest (a module on stage 1 may call a child on stage 0): while
a stage waits for an answer it serves the requests that reach it.

Exactness: each operation runs once, on the rank that owns its parameters, with the values it
would see in one process; the CPU RNG state travels with every call and every answer, so dropout
draws the single process's stream; each parameter's gradient is accumulated over the
microbatches in microbatch order on its owner. Gradients are therefore bitwise those of the same
model on one process with the same microbatch split. Tested on CPU with gloo; the CUDA RNG state
does not travel yet, and NCCL has not been run.

Schedule: one stage computes at a time, microbatch after microbatch (forward then the backward
the step function asks for). SMP's ``pipeline: "interleaved"`` and ``"simple"`` differ only in
the order stages overlap work, not in any value, so both run this order and give the same
gradients. What this gives is SMP's memory split (each stage saves only its own activations and
computes only its own parameters' gradients), not its overlap of stages in time. So at most one
microbatch's activations are alive on a stage at a time (``ALIVE_AT_ONCE``; ``most_alive`` counts
it on a serving stage: the microbatches its saved calls belong to).

For ``acshim run --budget`` (``acshim.planner.pipelines``) each stage keeps what its planning needs
to run its own part alone: the output shapes of every call it made to another stage
(``remote_specs``, replayed while ``replaying``: no message leaves the stage) and, on a serving
stage, the calls it served in the last whole microbatch (``ServedCalls`` runs them again).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from acshim.planner.replay import TensorSpec
from acshim.policy import strategy_groups
from acshim.region import run_region

from . import _pipeline_transport as transport
from ._partitioning import module_list, parents_of
from .exceptions import CheckpointingConfigError, SMPUnsupportedError
from .state_mod import state

ALIVE_AT_ONCE = 1
"""Microbatches whose activations a stage holds at once: the step function runs each microbatch's
forward and the backward it asks for before the next microbatch starts, for ``pipeline: "simple"``
and ``"interleaved"`` alike."""

# -- messages ---------------------------------------------------------------------------------------


@dataclass
class Assignment:
    partitions: list[int]


@dataclass
class Forward:
    request: int
    key: tuple[Any, ...]
    skeleton: Any
    tensors: list[torch.Tensor]
    requires_grad: list[bool]
    grad_enabled: bool
    rng: torch.Tensor
    microbatch: int = 0


@dataclass
class ForwardDone:
    request: int
    skeleton: Any
    tensors: list[torch.Tensor]
    requires_grad: list[bool]
    rng: torch.Tensor


@dataclass
class Backward:
    request: int
    grads: list[torch.Tensor | None]


@dataclass
class BackwardDone:
    request: int
    grads: list[torch.Tensor | None]


@dataclass
class Failed:
    """A request raised on the stage that ran it; the caller raises it again."""

    request: int
    error: str


@dataclass
class End:
    """The driver finished the step: its outputs (packed) and RNG state, or the error it hit (and
    ``exit_code`` where that error ends the process with one: ``SystemExit``, an ``acshim plan`` exit)."""

    outputs: Any = None
    tensors: list[torch.Tensor] = field(default_factory=list)
    rng: torch.Tensor | None = None
    error: str | None = None
    exit_code: int | None = None


class PipelineAborted(RuntimeError):
    """The driver's step function failed; the other stages stop with it."""


def exit_code_of(error: BaseException) -> int | None:
    """The process exit code an error ends the driver with: ``SystemExit`` and acshim's plan exit
    (both ``BaseException`` with an int ``code``); None for ordinary errors (exit 1)."""
    code = getattr(error, "code", None)
    return code if not isinstance(error, Exception) and isinstance(code, int) else None


def abort(message: End) -> BaseException:
    """What a stage raises when the driver ended the step with an error: the same exit code where
    the driver exits with one (so a launcher reports the same code from every rank, whichever it
    sees first), else ``PipelineAborted``."""
    if message.exit_code is not None:
        print(f"acshim: pipeline driver exited with code {message.exit_code}: {message.error}", file=sys.stderr,
              flush=True)
        return SystemExit(message.exit_code)
    return PipelineAborted(message.error)


# -- the autograd seam ------------------------------------------------------------------------------


class RemoteCall(torch.autograd.Function):
    """Forward: run a call on another stage. Backward: send it the output grads, get input grads."""

    @staticmethod
    def forward(ctx: Any, runner: StageRunner, stage: int, key: tuple[Any, ...], box: list[Any],
                _anchor: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        request, outputs, requires_grad = runner.forward_on(stage, key, box[0], list(tensors), grad_enabled=True)
        box[0] = outputs[0]
        ctx.runner, ctx.stage, ctx.request = runner, stage, request
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*(t for t, needed in zip(outputs[1], requires_grad) if not needed))
        return tuple(outputs[1])

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        input_grads = ctx.runner.backward_on(ctx.stage, ctx.request, list(grads))
        return (None, None, None, None, None, *input_grads)


# -- the runner -------------------------------------------------------------------------------------


class StageDispatch:
    """The instance ``forward`` of a module whose partition differs from its parent's: runs the
    forward it replaced on the owning stage, here or through the runner."""

    def __init__(self, runner: StageRunner, module: nn.Module) -> None:
        self.runner = runner
        self.index = runner.index[module]
        self.stage = runner.partition[module]
        self.inner = module.__dict__.get("forward", type(module).forward.__get__(module))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.stage == self.runner.stage:
            return self.inner(*args, **kwargs)
        return self.runner.call(self.stage, ("call", self.index), args, kwargs)


class PipelinedSequential:
    """The instance ``forward`` of a checkpointed ``nn.Sequential`` whose children span partitions:
    ``groups`` of consecutive children, each on one stage, run there (as one region when
    checkpointed), each group's output feeding the next."""

    def __init__(self, runner: StageRunner, module: nn.Sequential, groups: Sequence[tuple[int, tuple[int, ...]]],
                 preserve_rng_state: bool, pack_args_as_tuple: bool) -> None:
        self.runner, self.index, self.groups = runner, runner.index[module], list(groups)
        self.preserve_rng_state, self.pack_args_as_tuple = preserve_rng_state, pack_args_as_tuple

    def __call__(self, input: Any) -> Any:
        for stage, members in self.groups:
            key = ("group", self.index, members, True, self.preserve_rng_state, self.pack_args_as_tuple)
            input = self.runner.run_on(stage, key, (input,), {})
        return input


def partition_groups(stages: Sequence[int], strategy: str) -> list[tuple[int, tuple[int, ...]]]:
    """SMP's ``checkpoint_sequential`` strategies over children on several partitions (``stages``:
    each child's partition): a group never crosses a partition boundary. ``"each"``: one child per
    group; ``"contiguous"``: each run of children on one partition; ``"group_N"``: N children per
    group, counted afresh in each run, so a group at a boundary comes out shorter."""
    runs: list[list[int]] = []
    for child, stage in enumerate(stages):
        if runs and stages[runs[-1][-1]] == stage:
            runs[-1].append(child)
        else:
            runs.append([child])
    groups: list[tuple[int, tuple[int, ...]]] = []
    for run in runs:
        for chunk in strategy_groups(strategy, len(run)):
            groups.append((stages[run[0]], tuple(run[i] for i in chunk)))
    return groups


class StageRunner:
    """One rank's stage of a partitioned model: dispatches calls, serves requests, ends steps."""

    def __init__(self, root: nn.Module, partitions: Sequence[int], stage: int, ranks: Sequence[int],
                 manual: bool) -> None:
        self.root = root
        self.modules = module_list(root)
        if len(partitions) != len(self.modules):
            raise RuntimeError(f"partition assignment for {len(partitions)} modules, the model has {len(self.modules)}: "
                               "every rank must build the same model before smp.DistributedModel")
        self.index = {m: i for i, m in enumerate(self.modules)}
        self.partition = dict(zip(self.modules, partitions))
        self.parents = parents_of(root)
        self.stage, self.ranks, self.manual = stage, list(ranks), manual
        self.records: dict[tuple[int, int], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self._next_request = 0
        self._warned: set[int] = set()
        self.parameter_stage = self._parameter_stages()
        self.steps = 0
        """Steps ended so far (with ``microbatch``, where a stage is in the run)."""
        self.served_microbatch = 0
        self.remote_specs: dict[tuple[int, tuple[Any, ...]], tuple[Any, list[TensorSpec]]] = {}
        """Per (stage, call key): the skeleton and tensor specs of the latest answer (for ``replaying``)."""
        self.replaying = False
        """While set, a call to another stage returns outputs shaped as its last answer, sending nothing."""
        self.largest_message = 0
        """The most tensor bytes one call's arguments or answer carried."""
        self.served_calls: list[ServedCall] = []
        self.last_served_calls: list[ServedCall] = []
        """The calls served in the last whole microbatch (a serving stage's planning runs them again)."""
        self._served_key: tuple[int, int] | None = None
        self._alive: dict[tuple[int, int], int] = {}
        self.most_alive = 0
        """The most microbatches whose saved calls this stage held at once."""

    # -- placement queries ----------------------------------------------------------------------

    def _parameter_stages(self) -> dict[nn.Parameter, int]:
        stages: dict[nn.Parameter, int] = {}
        names = {m: n for n, m in self.root.named_modules()}
        for module in self.modules:
            for name, parameter in module.named_parameters(recurse=False):
                stage = self.partition[module]
                if stages.setdefault(parameter, stage) != stage:
                    raise SMPUnsupportedError(
                        f"parameter {names[module]}.{name} is shared by modules on partitions {stages[parameter]} and "
                        f"{stage}: acshim does not tie weights across pipeline partitions; place the modules that "
                        "share it on one partition (smp.partition / smp.set_partition)")
        return stages

    def release_other_partitions(self) -> None:
        """Free the storage of every parameter another stage owns (it becomes an empty tensor of the
        same dtype and device): this rank never computes with it, and its owner saves it."""
        for parameter, stage in self.parameter_stage.items():
            if stage != self.stage:
                parameter.data = torch.empty(0, dtype=parameter.dtype, device=parameter.device)
                parameter.grad = None

    def stages_of(self, module: nn.Module) -> set[int]:
        """The partitions ``module`` and its descendants lie on."""
        return {self.partition[m] for m in module.modules()}

    def is_local_parameter(self, parameter: nn.Parameter) -> bool:
        return self.parameter_stage.get(parameter, 0) == self.stage

    # -- checkpointing under partitions (SMP v1's rules) ---------------------------------------------

    def split_module(self, module: nn.Module, what: str) -> None:
        """``module`` must be checkpointed but spans partitions: an error when partitions are manual,
        a warning (once per module) when they are automatic; the caller then runs it plainly."""
        stages = sorted(self.stages_of(module))
        name = next((n or "main" for n, m in self.root.named_modules() if m is module), type(module).__name__)
        if self.manual:
            raise CheckpointingConfigError(
                f"{what} of module {name!r}: its module tree spans partitions {stages}, and a checkpointed module "
                "must lie within one partition; place it on one partition (smp.partition / smp.set_partition)")
        if self.index[module] not in self._warned:
            self._warned.add(self.index[module])
            warnings.warn(f"automatic partitioning split module {name!r} across partitions {stages}: it won't be "
                          "checkpointed (a checkpointed module must lie within one partition)", stacklevel=3)

    def checkpoint(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                   preserve_rng_state: bool) -> Any:
        """``smp.checkpoint(module, ...)`` inside a partitioned model."""
        stages = self.stages_of(module)
        if len(stages) > 1:
            self.split_module(module, "smp checkpoint")
            return module(*args, **kwargs)
        return self.run_on(stages.pop(), ("checkpoint", self.index[module], preserve_rng_state), args, kwargs)

    def sequential(self, module: nn.Sequential, input: Any, strategy: str, preserve_rng_state: bool,
                   pack_args_as_tuple: bool) -> Any:
        """``checkpoint_sequential`` inside a partitioned model: each group runs as one region on its stage."""
        forward = self.sequential_forward(module, strategy, preserve_rng_state, pack_args_as_tuple)
        return module(input) if forward is None else forward(input)

    def sequential_forward(self, module: nn.Sequential, strategy: str, preserve_rng_state: bool,
                           pack_args_as_tuple: bool) -> Callable[[Any], Any] | None:
        """The forward running ``module``'s children in checkpointed groups on their stages; None (after
        the error or warning of ``split_module``) when a child itself spans partitions."""
        children = list(module)
        for child in children:
            if len(self.stages_of(child)) > 1:
                self.split_module(child, "checkpointing a child of nn.Sequential")
                return None
        stages = [self.partition[c] for c in children]
        return PipelinedSequential(self, module, partition_groups(stages, strategy), preserve_rng_state,
                                   pack_args_as_tuple)

    # -- running calls ----------------------------------------------------------------------------

    def run_on(self, stage: int, key: tuple[Any, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if stage == self.stage:
            return self.run_target(key, args, kwargs)
        return self.call(stage, key, args, kwargs)

    def run_target(self, key: tuple[Any, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run the call ``key`` names on this stage."""
        from .patches.checkpoint import region_options

        kind, index = key[0], key[1]
        module = self.modules[index]
        if kind == "call":
            return module.forward.inner(*args, **kwargs)
        if kind == "checkpoint":
            return run_region(module, args, kwargs, region_options(key[2]))
        members = [list(module)[i] for i in key[2]]
        checkpointed, preserve_rng_state, pack = key[3], key[4], key[5]

        def run_group(*packed: Any) -> Any:
            value = packed if pack else packed[0]
            for child in members:
                value = child(value)
            return value

        (input,) = args
        inputs = tuple(input) if pack and isinstance(input, (tuple, list)) else (input,)
        if checkpointed:
            return run_region(run_group, inputs, {}, region_options(preserve_rng_state))
        return run_group(*inputs)

    def budget_stage(self) -> dict[str, Any]:
        """What ``acshim run --budget`` plans this stage by (``acshim.planner.pipelines``, which imports
        nothing of this facade): the schedule's name, microbatches, how many are alive at once, and,
        on a serving stage, the module that runs its calls of one microbatch again."""
        cfg = state.config()
        return {"schedule": str(cfg.values["pipeline"]), "microbatches": int(cfg.microbatches),
                "in_flight": ALIVE_AT_ONCE, "served": ServedCalls(self) if self.stage else None}

    def microbatch_key(self) -> tuple[int, int]:
        """(steps ended, microbatch) of the work this stage is doing now."""
        return (self.steps, state.microbatch if self.stage == 0 else self.served_microbatch)

    def call(self, stage: int, key: tuple[Any, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run ``key`` on ``stage`` with these arguments; differentiable when grad is enabled."""
        if self.replaying:
            return self._replay(stage, key, args, kwargs)
        skeleton, tensors = transport.pack((args, kwargs))
        if not torch.is_grad_enabled():
            _, (out_skeleton, out_tensors), _ = self.forward_on(stage, key, skeleton, tensors, grad_enabled=False)
            return transport.unpack(out_skeleton, out_tensors)
        box = [skeleton]
        anchor = torch.empty(0, requires_grad=True)  # makes the outputs differentiable for remote parameters
        outputs = RemoteCall.apply(self, stage, key, box, anchor, *tensors)
        return transport.unpack(box[0], list(outputs))

    def forward_on(self, stage: int, key: tuple[Any, ...], skeleton: Any, tensors: list[torch.Tensor],
                   grad_enabled: bool) -> tuple[int, tuple[Any, list[torch.Tensor]], list[bool]]:
        request = self._next_request
        self._next_request += 1
        message = Forward(request, key, skeleton, [transport.wire_copy(t) for t in tensors],
                          [t.requires_grad for t in tensors], grad_enabled, torch.get_rng_state(),
                          self.microbatch_key()[1])
        transport.send(message, self.ranks[stage])
        answer = self.wait_for(ForwardDone, request)
        torch.set_rng_state(answer.rng)
        self.remote_specs[(stage, key)] = (answer.skeleton, [
            TensorSpec(tuple(t.shape), t.dtype, t.device, needed) for t, needed in zip(answer.tensors, answer.requires_grad)])
        self.largest_message = max(self.largest_message, _bytes(tensors), _bytes(answer.tensors))
        return request, (answer.skeleton, answer.tensors), answer.requires_grad

    def _replay(self, stage: int, key: tuple[Any, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call to another stage while planning: outputs shaped as its last answer, connected to
        the call's inputs for backward (``acshim.planner.replay``); nothing is sent."""
        from acshim.planner.replay import replay_spec

        recorded = self.remote_specs.get((stage, key))
        if recorded is None:
            raise RuntimeError(f"pipeline stage {self.stage}: planning reached a call to stage {stage} ({key[0]}) that "
                               "the last microbatch did not make; its output shapes are unknown")
        skeleton, specs = recorded
        outputs = replay_spec(list(specs), args, kwargs) if specs else []
        return transport.unpack(skeleton, list(outputs))

    def backward_on(self, stage: int, request: int, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        transport.send(Backward(request, [transport.wire_copy(g) for g in grads]), self.ranks[stage])
        return self.wait_for(BackwardDone, request).grads

    def wait_for(self, kind: type, request: int) -> Any:
        """Serve requests until the answer to ``request`` arrives."""
        while True:
            sender, message = transport.receive()
            if isinstance(message, kind) and message.request == request:
                return message
            if isinstance(message, Failed) and message.request == request:
                raise RuntimeError(f"pipeline stage of rank {sender} failed: {message.error}")
            if isinstance(message, End) and message.error is not None:
                raise abort(message)
            self.serve(sender, message)

    # -- serving ----------------------------------------------------------------------------------

    def serve(self, sender: int, message: Any) -> None:
        """Run a request from ``sender``; an error goes back to it (the caller raises it)."""
        if not isinstance(message, (Forward, Backward)):
            raise RuntimeError(f"pipeline stage {self.stage} got an unexpected {type(message).__name__} from rank {sender}")
        try:
            if isinstance(message, Forward):
                self._serve_forward(sender, message)
            else:
                self._serve_backward(sender, message)
        except PipelineAborted:
            raise
        except Exception as error:  # every failure goes back to the waiting caller
            transport.send(Failed(message.request, f"{type(error).__name__}: {error}"), sender)

    def _note_served(self, sender: int, message: Forward) -> None:
        """Keep the call's shape for planning; a new microbatch moves the last one's calls aside."""
        key = (self.steps, message.microbatch)
        if key != self._served_key:
            if self.served_calls:
                self.last_served_calls = self.served_calls
            self.served_calls, self._served_key = [], key
        self.served_microbatch = message.microbatch
        self.served_calls.append(ServedCall(message.key, message.skeleton, [
            TensorSpec(tuple(t.shape), t.dtype, t.device, False) for t in message.tensors],
            list(message.requires_grad), message.grad_enabled))
        self.largest_message = max(self.largest_message, _bytes(message.tensors))

    def _serve_forward(self, sender: int, message: Forward) -> None:
        self._note_served(sender, message)
        inputs = [t.requires_grad_(needed) if needed and (t.is_floating_point() or t.is_complex()) else t
                  for t, needed in zip(message.tensors, message.requires_grad)]
        torch.set_rng_state(message.rng)
        with torch.set_grad_enabled(message.grad_enabled):
            # the module gets a non-leaf copy of each input that requires grad, as it would in one
            # process: an in-place op on its input (ReLU(inplace=True)) is then allowed; a clone's
            # backward passes the gradient through unchanged
            used = [t.clone() if t.requires_grad and message.grad_enabled else t for t in inputs]
            args, kwargs = transport.unpack(message.skeleton, used)
            skeleton, outputs = transport.pack(self.run_target(message.key, args, kwargs))
        requires_grad = [t.requires_grad for t in outputs]
        self.largest_message = max(self.largest_message, _bytes(outputs))
        if message.grad_enabled and any(requires_grad):
            self.records[(sender, message.request)] = (inputs, outputs)
            self._alive[(sender, message.request)] = message.microbatch
            self.most_alive = max(self.most_alive, len(set(self._alive.values())))
        transport.send(ForwardDone(message.request, skeleton, [transport.wire_copy(t) for t in outputs],
                                   requires_grad, torch.get_rng_state()), sender)

    def _serve_backward(self, sender: int, message: Backward) -> None:
        inputs, outputs = self.records.pop((sender, message.request))
        self._alive.pop((sender, message.request), None)
        pairs = [(o, g) for o, g in zip(outputs, message.grads) if g is not None and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads = [t.grad if t.requires_grad else None for t in inputs]
        transport.send(BackwardDone(message.request, grads), sender)

    def serve_step(self) -> End:
        """A stage other than the driver: serve until the driver ends the step."""
        while True:
            sender, message = transport.receive()
            if isinstance(message, End):
                self.records.clear()
                self._alive.clear()
                self.steps += 1
                if message.error is not None:
                    raise abort(message)
                return message
            self.serve(sender, message)

    def end_step(self, outputs: Any = None, error: str | None = None, exit_code: int | None = None) -> None:
        """The driver: tell every other stage the step is over (with its outputs, or its error)."""
        self.records.clear()
        self.steps += 1
        skeleton, tensors = transport.pack(outputs)
        message = End(skeleton, [transport.wire_copy(t) for t in tensors], torch.get_rng_state(), error, exit_code)
        for stage, rank in enumerate(self.ranks):
            if stage != self.stage:
                transport.send(message, rank)


@dataclass
class ServedCall:
    """A call a serving stage ran: what it ran, and its arguments' shapes."""

    key: tuple[Any, ...]
    skeleton: Any
    specs: list[TensorSpec]
    requires_grad: list[bool]
    grad_enabled: bool


class ServedCalls(nn.Module):
    """A serving stage's part of one microbatch as one module, for planning it alone: the calls it
    served in the last whole microbatch run again in order, each on fresh arguments of the recorded
    shapes handled as ``_serve_forward`` handles a request's (a clone of each input that requires
    grad), its calls to other stages replayed (``replaying``). Returns the sum of every output that
    requires grad first (a backward through it reaches every call), then the outputs."""

    def __init__(self, runner: StageRunner) -> None:
        super().__init__()
        self.model = runner.root
        object.__setattr__(self, "runner", runner)
        self.calls = list(runner.last_served_calls)

    def forward(self) -> tuple[torch.Tensor, ...]:
        outputs: list[torch.Tensor] = []
        for call in self.calls:
            inputs = [_fresh(spec, needed) for spec, needed in zip(call.specs, call.requires_grad)]
            with torch.set_grad_enabled(call.grad_enabled):
                used = [t.clone() if t.requires_grad and call.grad_enabled else t for t in inputs]
                args, kwargs = transport.unpack(call.skeleton, used)
                _, produced = transport.pack(self.runner.run_target(call.key, args, kwargs))
            outputs += [t for t in produced if t.requires_grad]
        if not outputs:
            raise RuntimeError(f"pipeline stage {self.runner.stage}: the last microbatch's calls here computed "
                               "nothing that needs a gradient")
        return (sum(t.float().sum() for t in outputs), *outputs)


def _fresh(spec: TensorSpec, needed: bool) -> torch.Tensor:
    tensor = torch.zeros(spec.shape, dtype=spec.dtype, device=spec.device)
    return tensor.requires_grad_() if needed and (tensor.is_floating_point() or tensor.is_complex()) else tensor


def _bytes(tensors: Sequence[torch.Tensor | None]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def install(runner: StageRunner) -> None:
    """Put a ``StageDispatch`` on every module whose partition differs from its parent's (the root's
    parent being the driver, stage 0); call after checkpointing is applied, so it is outermost."""
    for module in runner.modules:
        parent = runner.parents.get(module)
        parent_stage = runner.partition[parent] if parent is not None else 0
        if runner.partition[module] != parent_stage:
            module.forward = StageDispatch(runner, module)


__all__ = ["ALIVE_AT_ONCE", "Assignment", "End", "PipelineAborted", "RemoteCall", "ServedCall", "ServedCalls",
           "StageDispatch", "StageRunner", "abort", "exit_code_of", "install", "partition_groups"]
