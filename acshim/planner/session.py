"""``acshim run --budget``, ``acshim plan`` and ``acshim.plan``: a step's own checkpoint calls get the plan.

Design. Every dialect's checkpoint call reaches the engine's ``run_region``; while a ``PlanSession``
is active (``acshim.region.ROUTERS``) ``run_region`` hands the call to ``PlanSession.route`` instead.
Regions are keyed by their **position in the step**: the model's forward pre-hook resets the count,
so a DeepSpeed closure, a ``checkpoint_wrapper`` module or a Hugging Face layer are all "region i".

The budget is memory above what the process held when the step started (``steps.StepStart``, or
the moment ``acshim.plan`` is called), as the process sees it (``process``). The first region call
of the script's first step plans, there and then, within the budget:
1. the model being run is the outermost ``nn.Module`` call on the stack (data-parallel wrappers
   skipped), with the inputs it was called with;
2. ``profiler.RegionProfiler`` measures it under a guard that stops any measurement going over the
   budget: a forward that counts what each region would save, the part outside the regions alone,
   each distinct region alone per choice;
3. ``plan.solve_within`` solves exactly and verifies on one step of the model, as the process sees
   it, re-solving under a tighter target if it went over;
4. gradients, RNG state and buffers are put back, and the interrupted step continues under the
   plan (an offloaded outside part from this region on); one line on stderr says what was replaced.
Then the next steps are timed (``feedback``): a plan measurably slower than predicted is solved
again with the measured costs. A step whose inputs are larger than any planned for is planned again
before its forward starts (dynamic padding), within the same budget in bytes. ``plan_file``: a plan
saved by an earlier run of the same model, batch shape and budget is used without profiling (on a
pipeline, one file per stage: ``plan.stage_plan_file``).

A model sharded across ranks (FSDP, ZeRO-3: collectives inside every block's hooks) cannot run
blocks alone, so it is planned on the script's own steps instead (``lockstep``): mode ``explore``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .. import host_allocator
from .. import region as engine
from ..options import RegionOptions
from ..region import owning_module, run_region_now
from ..region_dialect import ENGINE
from ..storage import no_offload
from ..wrap import checkpointed_forward_of
from .agree import agree_bytes, agree_measurement, agree_profile
from .aliases import parameters_aliased
from .budget import BetweenBudget, budget_at_least, budget_fraction, check_budget, format_bytes, parse_budget
from .choices import (
    ASKED,
    BASE_CHOICES,
    SharedOffload,
    choice_options,
    copies_outlive_blocks,
    expand_choices,
    install_outside,
    offload_scopes,
    outside_choices,
    split_outside,
)
from .estimate import step_peak
from .feedback import StepTimer
from .ledger import ChargeLedger
from .lockstep import LockstepPlanner
from .picture import write_png as write_picture
from .pipelines import PipelineStage, ScheduleHeld, UnplannedPipeline, pipeline_on_stack
from .plan import (
    HEADROOM,
    NoPlanMeasured,
    Plan,
    PlanFileMismatch,
    least_budget,
    load_plan_file,
    reference,
    solve_within,
    stage_plan_file,
)
from .process import (
    OverBudget,
    ProcessMemory,
    check_memory_kind,
    guard_limit,
    guarded_budget,
    release_stopped,
    trim,
)
from .profile import (
    INFEASIBLE,
    Profile,
    feasible,
    input_shapes,
    larger_inputs,
    largest_inputs,
    model_signature,
)
from .profiler import RegionProfiler, Verification, detached_inputs
from .refusal import Charges, Refusal
from .report import frontier_table, plan_line, plan_outcome, plan_replacing
from .routing import Mode
from .script_loss import ScriptLossWindow
from .sites import (
    RegionSite,
    describe,
    device_of,
    model_on_stack,
    rank,
    sharded_by,
    site_names,
    world_size,
)
from .snapshot import ModelSnapshot
from .solver import BudgetTooSmall, fastest, minimum_peak, rounded_peak, solve, unit_of
from .stage_share import StageShare
from .steps import StepStart, device_key, held_now
from .training_state import OptimizerWatch, foreseen_optimizer_state
from .warmup import warm_up

METHOD = ("measured on the script's first step under a guard on the process's memory: one forward counted what "
          "each region saves, the rest of the model ran alone (regions replayed), kept and offloaded, each distinct "
          "region ran alone per choice (least memory first), one step verified the plan")


class _PlanRefused(Exception):
    """A plan made again at a step's start was refused (the refusal as ``acshim run`` words it): the
    run goes on (``PlanSession._plan_again``)."""


class PlanExit(BaseException):
    """Ends the script from inside its first step: ``code`` 0 after ``acshim plan``, 2 on bad input
    or a budget that cannot be met (``message`` says which argument and how to fix it)."""

    def __init__(self, code: int, message: str = "") -> None:
        super().__init__(message)
        self.code, self.message = code, message


FAKE_PEAK_SHARE = 0.9
"""Share of the fake step's peak (tensor storages, gradients excluded) taken as a lower bound of no
checkpointing's peak as the process sees it: the process holds those tensors at that moment, and
the 10% covers what fake tensors count that the real step frees earlier. (Its forward's
high-water mark alone was too low a bound where the loss's backward dominates: a 32k vocabulary.)"""


@dataclass

class PlanSession:
    """The router ``acshim run --budget`` installs (see the module docstring). ``api``: used by
    ``acshim.plan`` (errors raised as they are, nothing printed, ``reuse`` a profile)."""

    budget: int | float | str
    choices: tuple[str, ...] = BASE_CHOICES
    storage: str | None = None
    prefetch: int = 2
    repeats: int = 1
    exit_after_plan: bool = False
    sweep: bool = False
    png: str | None = None
    plan_file: str | None = None
    loss_fn: Callable[[Any], torch.Tensor] | None = None
    verify: bool = True
    retries: int = 6
    reuse: Profile | None = None
    api: bool = False
    feedback: bool = True
    memory: str = "process"
    """``process`` (the budget is the process's memory, guarded and verified) or ``tensors`` (tensor
    storages as the tracker counts them: no guard; small test models, whose activations are below
    what the process's memory resolves)."""
    mode: Mode = Mode.IDLE
    """How ``route`` runs a region call (``routing.Mode``): idle (-> deferred: an SMP v1 stage; explore: a
    sharded model) -> plain / count / replay / alone / measure (planning) -> planned. Only this class
    assigns it; other modules ask for another mode for a while through ``routing``."""
    position: int = 0
    sites: list[RegionSite] = field(default_factory=list)
    plan: Plan | None = None
    root: nn.Module | None = None
    names: list[str] = field(default_factory=list)
    world: int = 1
    replans: int = 0
    _handle: Any = None
    _candidate: list[str] | None = None
    _shared: dict[str, SharedOffload] = field(default_factory=dict)
    _outside: str = "keep"
    """How the part of the model outside the regions runs now (the plan's, or a candidate's)."""
    _profiler: RegionProfiler | None = None
    _start: StepStart | None = None
    _memory: ProcessMemory | None = None
    _baseline: int | None = None
    """What ``_memory`` read at the first planned step's start (``_take_baseline``)."""
    _held_at_start: dict[str, int] | None = None
    """``steps.held_now`` at that start, per device, before the model's device was known."""
    _budget_bytes: int | None = None
    """A fractional budget in bytes, fixed by the first plan (later plans keep it)."""
    _planned_shapes: list[list[int]] = field(default_factory=list)
    _timer: StepTimer | None = None
    _from_file: bool = False
    _fake_peak: int = 0
    """No checkpointing's peak from one step on fake tensors (``estimate``), where it ran."""
    _count_refusal: BudgetTooSmall | None = None
    """The refusal the counting forward's stop would have given, where it was counted again within
    what that refusal names (``_profile``); None where it was not stopped."""
    _lockstep: LockstepPlanner | None = None
    """A sharded model's planner on its real steps (``lockstep``)."""
    _host_allocator: bool = False
    """Whether this session installed acshim's CPU allocator (``host_allocator``): for the run under
    ``acshim run``; under ``acshim.plan`` from the call on, kept where it returns a plan (``stop``)."""
    _step_plan: Plan | None = None
    """What the rest of the planning step runs in the plan's stead (``_planning_step_plan``), until
    the next step starts; None once the plan itself runs."""
    _replanning: bool = False
    """Whether a plan is being made again at a step's start (``_plan_again``): its refusal lets the run
    go on rather than end it."""
    pipeline: PipelineStage | None = None
    """This rank's pipeline stage (``pipelines``): planned alone, for one microbatch within the
    budget less what the schedule holds, divided by the microbatches it keeps alive at once."""
    _share: StageShare | None = None
    """This rank's pipeline stage's budget, split between what its schedule holds outside the stage
    module and the microbatches alive at once (``stage_share``)."""
    _script_window: ScriptLossWindow | None = None
    """Watches the script's own loss on the planning step (``script_loss``), until the next step."""
    _charged: ChargeLedger = field(default_factory=ChargeLedger)
    """What the plan in force was charged for besides its verification's measurement, and what the
    process held when it was solved (``ledger``): the script's own part, code paged in, optimizer
    state foreseen, what ``acshim.plan``'s warm-up loaded; the optimizers that stepped."""
    _base_besides: int = 0
    """What a step holds besides its activations, as the first plan was profiled: what the process
    held above the step's start then, the code the step paged in, the optimizer state foreseen and the
    script's own loss as charged. No checkpointing's step holds them too, and ``VmHWM`` counts them,
    so they are part of the peak a fraction is of (``_fraction_in_bytes``), as they are of each plan's
    predicted whole step (``Plan.overhead``)."""
    _resident_at_start: int = 0
    """``VmRSS`` when the baseline was read (a pipeline rank's measured peak is ``VmHWM`` above it)."""
    _position_key: Any = None
    """The microbatch a pipeline stage whose regions run outside one module call is in (SMP v1)."""
    _rank: int = 0

    # ---------------------------------------------------------------------------------- lifetime
    @property
    def planned_nothing(self) -> bool:
        """True when no checkpointed region ran with grad enabled: there was nothing to plan."""
        return self.mode == Mode.IDLE

    @property
    def still_deferred(self) -> bool:
        """True when an SMP v1 pipeline stage (which plans on its second microbatch) never got one."""
        return self.mode == Mode.DEFERRED

    @property
    def still_exploring(self) -> bool:
        """True while a sharded model is planned on the script's own steps and has no plan yet."""
        return self.mode == Mode.EXPLORE

    def start(self, baseline_now: bool = False) -> PlanSession:
        """Check the arguments, load what planning uses (``warmup``) and route every region call to
        this session. The budget is above the process memory at the start of the outermost module
        call the plan is made in, or, with ``baseline_now``, the memory now."""
        check_budget(self.budget)
        check_memory_kind(self.memory)
        expand_choices(self.choices, ("disk",))
        self._memory = ProcessMemory("cpu", enabled=self.memory == "process")
        before = held_now(self._memory) if baseline_now else None
        with _counters_paused():  # the warm-up's tiny layer is not the script's region
            warm_up(self.choices, self.storage)
        if baseline_now:
            self._held_at_start = held_now(self._memory)
            self._baseline = self._held_at_start["cpu"]
            assert before is not None
            # acshim.plan's budget is above what the process held when it was called: the code and
            # state its warm-up loaded there the first time (9 to 25 MiB measured on CPU: torch._dynamo,
            # acshim's extensions) are the process's from then on, and charged to the plan
            self._charged.loaded = sum(max(0, self._held_at_start[key] - before.get(key, 0)) for key in ("cpu", "file"))
        else:
            self._start = StepStart(self._memory).start()
        if not self.api:  # acshim.plan ends before the script's steps
            self._charged.watch = OptimizerWatch().start()
        if self.memory == "process" and not host_allocator.installed():
            # acshim run: the run's own tensor allocator, caching once the plan runs. acshim.plan: from
            # the call on, kept where it returns a plan, so that what it measures and the steps after
            # it follow what tensors hold even where the heap does not (steps that ran before the mmap
            # threshold was fixed leave free chunks in the heap, which later tensors reuse and never
            # give back: HF Llama 6x384 at 0.5 was refused, every plan measured over its prediction;
            # planned on this allocator but run on the heap, its steps held 85 MiB of a 55 MiB budget)
            self._host_allocator = host_allocator.install()
        engine.ROUTERS.append(self)
        return self

    def stop(self, keep_allocator: bool = False) -> None:
        """Stop routing; regions run as the script asked again. ``keep_allocator``: acshim's CPU
        allocator, where this session installed it, stays torch's, caching (``acshim.plan``'s plan
        is then kept by the steps that follow it)."""
        if self in engine.ROUTERS:
            engine.ROUTERS.remove(self)
        if self._start is not None:
            self._start.stop()
            self._start = None
        if self._lockstep is not None:
            self._lockstep.stop()
            self._lockstep = None
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self._charged.watch is not None:
            self._charged.watch.stop()
            self._charged.watch = None
        if self._timer is not None:
            self._timer.stop()
            self._timer = None
        if self._script_window is not None:
            self._script_window.close()
            self._script_window = None
        if self.root is not None and self._outside != "keep":
            install_outside(self.root, "keep")  # the model's own forward back
            self._outside = "keep"
        if self._host_allocator:
            if keep_allocator:
                host_allocator.enable_cache()
            else:
                host_allocator.uninstall()
            self._host_allocator = False

    # ---------------------------------------------------------------------------------- routing
    def route(self, function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
              options: RegionOptions) -> Any:
        """Run one region call of the script's as the mode says (``routing.Mode``)."""
        if self.pipeline is not None and self.pipeline.microbatch_key is not None:
            key = self.pipeline.microbatch_key()  # a stage whose regions run outside one module call (SMP v1)
            if key != self._position_key:
                self._position_key, self.position = key, 0
                if self.mode == Mode.DEFERRED:  # a microbatch ran whole: its calls' shapes are known
                    self.mode = Mode.IDLE
        if self.mode == Mode.IDLE:
            self._plan_now(function, args, kwargs, options)
        index = self.position
        self.position += 1
        match self.mode:
            case Mode.PLAIN:
                return function(*args, **kwargs)
            case Mode.DEFERRED:
                return run_region_now(function, args, kwargs, self._least_options())
            case Mode.EXPLORE:
                self._site(index, function, options).calls += 1
                return self._lockstep.explore(index, function, args, kwargs)  # type: ignore[union-attr]
            case Mode.COUNT:
                site = self._site(index, function, options)
                return self._profiler.count_region(index, function, args, kwargs, site)  # type: ignore[union-attr]
            case Mode.REPLAY if index < len(self.sites):
                return self._profiler.replay_region(index, args, kwargs)  # type: ignore[union-attr]
            case Mode.MEASURE:
                return self._run_planned(self._candidate, index, function, args, kwargs, options)
            case Mode.PLANNED:
                running = self._step_plan or self.plan
                return self._run_planned(running.choices if running else None, index, function, args, kwargs,
                                         options, self._timer)
            case _:  # idle, alone (a call nested in the region measured), replay past the recorded regions
                return run_region_now(function, args, kwargs, RegionOptions())

    def _run_planned(self, choices: list[str] | None, index: int, function: Callable[..., Any],
                     args: tuple[Any, ...], kwargs: dict[str, Any], options: RegionOptions,
                     timer: StepTimer | None = None) -> Any:
        """Region call ``index`` as ``choices[index]`` (a candidate's or the plan's), timed by ``timer``."""
        if choices is None or index >= len(choices):
            return run_region_now(function, args, kwargs, RegionOptions())  # more regions than planned: safe
        site = self._site(index, function, options)
        site.calls += 1
        if timer is not None:
            return timer.region(index, lambda: self.run_choice(site, choices[index], function, args, kwargs),
                                args, kwargs)
        return self.run_choice(site, choices[index], function, args, kwargs)

    @contextlib.contextmanager
    def routing(self, mode: Mode, candidate: list[str] | None = None,
                schedules: dict[str, SharedOffload] | None = None) -> Iterator[None]:
        """Route region calls in ``mode`` inside the ``with`` block: with ``candidate``'s choices
        (``Mode.MEASURE``), the offloaded regions sharing ``schedules`` (``choices.SharedOffload``). The
        mode, candidate and schedules are put back when the block ends or raises."""
        saved = self.mode, self._candidate, self._shared
        self.mode = mode
        if candidate is not None:
            self._candidate = candidate
        if schedules is not None:
            self._shared = schedules
        try:
            yield
        finally:
            self.mode, self._candidate, self._shared = saved

    def run_outside(self, root: nn.Module, choice: str, schedules: dict[str, SharedOffload] | None = None) -> None:
        """Run the part of ``root`` outside the regions as ``choice`` from now on (``install_outside``;
        ``keep``: the model's own forward), its offloads sharing ``schedules``. A region kept inside an
        offloaded outside part is not offloaded (``run_choice``)."""
        install_outside(root, choice, self.prefetch, schedules)
        self._outside = choice

    def held_now(self) -> int | None:
        """What the process holds now above the first planned step's start (the heap's free memory
        given back first), or None where the process's memory cannot be read."""
        memory, baseline = self._memory, self._baseline
        if memory is None or not memory.available or baseline is None:
            return None
        trim()  # what the heap has freed is not held
        return memory.current() - baseline

    def offload_wait_seconds(self) -> float:
        """Seconds the offloaded regions' shared schedules have waited for prefetches, so far."""
        return sum(scope.session.stats.wait_seconds for scope in self._shared.values())

    @property
    def planned_budget(self) -> int | float | str:
        """The budget plans are solved within: a fractional budget's bytes once the first plan fixed
        them, else the budget as given."""
        return self._budget_bytes if self._budget_bytes is not None else self.budget

    def _site(self, index: int, function: Callable[..., Any], options: RegionOptions) -> RegionSite:
        if index < len(self.sites):
            return self.sites[index]
        owner = owning_module(function)
        # a facade that made the region marks its module (acshim_dialect) or names itself in the
        # region's options (RegionOptions.dialect, see acshim.region_dialect); else the engine's API
        site = RegionSite(function, owner, getattr(owner, "acshim_dialect", None) or options.dialect or ENGINE,
                          describe(options), asked_options=options)
        self.sites.append(site)
        return site

    def run_choice(self, site: RegionSite, choice: str, function: Callable[..., Any], args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> Any:
        """Run one region call as ``choice``."""
        if choice == ASKED:
            # the script's own options: its policy's offload decisions go to the storage tier
            # (acshim.selective.honour_offload); not under no_offload, which would keep them here
            return run_region_now(function, args, kwargs, site.asked_options or RegionOptions())
        base, _, tier = choice.partition(":")
        if base == "keep":
            engine.STATS.forward(function)
            if self._outside_offloaded():  # the model around it is offloaded: a kept region is not
                with no_offload():
                    return function(*args, **kwargs)
            return function(*args, **kwargs)
        if base == "offload":
            scope = self._shared.get(tier)
            if scope is None:  # one schedule for all offloaded regions of the step (choices.SharedOffload)
                scope = self._shared[tier] = SharedOffload(tier, self.prefetch)
            engine.STATS.forward(function)
            with scope:
                return function(*args, **kwargs)
        if site.options is None or site.choice != choice:
            site.options, site.choice = choice_options(choice), choice
        if self._outside_offloaded() and base != "recompute+offload":  # as for keep: not offloaded
            with no_offload():
                return run_region_now(function, args, kwargs, site.options)
        return run_region_now(function, args, kwargs, site.options)

    def _use_schedules(self, plan: Plan) -> None:
        """Fresh offload schedules for ``plan``'s tiers, letting its ``in_flight`` bytes be in flight."""
        self._shared = offload_scopes(plan.choices, plan.outside, self.prefetch, plan.in_flight)

    def _outside_offloaded(self) -> bool:
        """Whether the part outside the regions is offloaded now (not merely chunked: ``head``/``loss``
        move nothing, and ``no_offload``'s kept tensors would tie a step's graph into reference
        cycles that only its backward breaks: a verification stopped over budget leaked 13 MiB)."""
        return split_outside(self._outside)[0] != "keep"

    def _before_step(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        """The model's forward pre-hook: region positions restart; after planning, a step whose inputs
        are larger than any planned for is planned again before it runs (steps without grad, such as
        evaluation, run regions as plain calls and are left alone)."""
        self.position = 0
        if self._lockstep is not None and torch.is_grad_enabled() and module.training:
            self._lockstep_step(module, args, kwargs)
            return
        needed = None
        if self._script_window is not None:  # the planning step is over: its loss was watched
            needed = self._script_window.close()
            self._script_window = None
        if self._step_plan is not None and self.mode == Mode.PLANNED:
            self._run_plan_from_now(module)
        if self.mode != Mode.PLANNED or not torch.is_grad_enabled() or not module.training:
            return
        self._cache_planned_steps()
        shapes = input_shapes(args, kwargs)
        replans = self.replans
        if larger_inputs(shapes, self._planned_shapes):
            self._replan(module, tuple(args), dict(kwargs), shapes)
        elif needed is not None:
            self._charge_script_part(module, tuple(args), dict(kwargs), needed)
        if self.replans == replans:  # a plan solved just now was solved with what is held now
            self._charge_training_state(module, tuple(args), dict(kwargs))
        if self._timer is not None:
            self._timer.step_started(module, tuple(args), dict(kwargs))
        # a plan made or re-solved just now was verified on whole steps of the model, which moved
        # the count on: this step's regions start at 0 again (past the plan's end a region runs as
        # a plain recompute, the plan's offloads and keeps left out)
        self.position = 0

    def _cache_planned_steps(self) -> None:
        """A planned step starts: from here acshim's CPU allocator keeps freed blocks for the steps'
        tensors (``host_allocator``; a measurement made later starts by emptying it, ``trim``). Not on
        a pipeline stage: a cached block is resident when handed out, and a schedule allocates its
        receive buffers well before it fills them (docs/cli.md)."""
        if self._host_allocator and self.pipeline is None and not host_allocator.caching():
            host_allocator.enable_cache()

    # ---------------------------------------------------------------------------------- planning
    def _plan_now(self, function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                  options: RegionOptions) -> None:
        found = model_on_stack()
        self.world = world_size()
        try:
            self.pipeline = pipeline_on_stack()
        except UnplannedPipeline as error:
            self.stop()
            raise PlanExit(2, f"acshim run --budget {self.budget}: {error}") from None
        if self.pipeline is not None and self.pipeline.after_first_microbatch and self._position_key is None:
            self._plan_later(self.pipeline)  # this microbatch's regions hold least
            return
        if self.pipeline is not None:  # each stage is its own planning problem (pipelines)
            # planning's backwards must not reach the received activations: the schedule sends
            # their .grad to the previous stage (storage shared, no copy)
            found = (self.pipeline.module, *detached_inputs((self.pipeline.args, self.pipeline.kwargs)))
            # SMP v1 stages plan at their second microbatch, when the first has shown the calls' shapes
            which = "second" if self.pipeline.after_first_microbatch else "first"
            if self.plan_file:  # each stage has its own plan: its own file
                self.plan_file = stage_plan_file(self.plan_file, self.pipeline.stage)
            if self.exit_after_plan:
                self.stop()
                raise PlanExit(2, f"acshim plan: {self.pipeline.describe()}: each stage plans at its own {which} "
                                  "microbatch, and one stage ending there would leave the others waiting; run the "
                                  "script as acshim run --budget B (each stage's plan is logged)")
            self._share = StageShare(self.pipeline, self.pipeline.held(
                _stage_output_bytes(self, self.pipeline, found[1], found[2]) if self.pipeline.microbatch_key is None
                else 0))
            fraction = budget_fraction(self.budget)
            if fraction is None and self._budget_bytes is None:  # what the schedule holds is paid first
                self._budget_bytes = self._share.microbatch(parse_budget(self.budget, 1))
        sharded = sharded_by(found[0] if found is not None else None) if self.world > 1 and \
            self.pipeline is None else None
        if found is None:
            self.stop()
            raise PlanExit(2, "acshim run --budget: the first checkpointed region ran outside any nn.Module's forward, "
                              "so there is no model to plan for; checkpoint blocks inside the model's forward (or "
                              "drop --budget)")
        root, root_args, root_kwargs = found
        self._take_baseline(device_of(root))
        self.root = root
        self._handle = root.register_forward_pre_hook(self._before_step, with_kwargs=True)
        shapes = input_shapes(root_args, root_kwargs)
        if self.plan_file and os.path.exists(self.plan_file):
            self._use_plan_file(root, shapes)
            if sharded is not None:  # larger inputs later are explored on the script's steps, not profiled
                self._explore(root, shapes, now=False)
        elif sharded is not None and self.api:
            self.stop()
            raise PlanExit(2, f"acshim.plan: this model is sharded by {sharded} across {self.world} ranks; its blocks "
                              "gather parameters with collectives, so it is planned on the script's own steps: run "
                              "the script as torchrun ... -m acshim run --budget B train.py (or plan on one process)")
        elif sharded is not None:
            # FSDP / ZeRO gather parameters and reduce gradients with collectives inside each block's
            # hooks: running blocks alone would issue them out of step, so the plan is made on the
            # script's own steps (lockstep); this one runs every region with least memory, measured
            self._explore(root, shapes)
            return
        else:
            self._plan_on(root, root_args, root_kwargs, shapes)
            if self.pipeline is not None:  # what the stage's file is reused for (load_plan_file)
                self.plan.asked = str(self.budget)  # type: ignore[union-attr]
                self.plan.rank_budget = self._share.rank_budget if self._share is not None else 0  # type: ignore[union-attr]
            if self.plan_file and (rank() == 0 or self.pipeline is not None):  # each stage saves its own
                self.plan.save(self.plan_file)  # type: ignore[union-attr]
        self.mode, self.position = Mode.PLANNED, 0  # route() takes position 0 for the interrupted call
        assert self.plan is not None
        self._step_plan = self._planning_step_plan(self.plan)
        running = self._step_plan or self.plan
        self._use_schedules(running)
        if running.outside != "keep":
            install_outside(root, running.outside, self.prefetch, self._shared)
            self._outside = running.outside
            offload_part = split_outside(running.outside)[0]
            if offload_part != "keep":
                _offload_rest_of_forward(root, self._shared[offload_part.partition(":")[2]])
        self._announce(self.plan)
        if self.feedback and self.world == 1 and self._step_plan is None:  # else from the plan's first step
            self._timer = StepTimer(self)
        if self._watches_script_loss():
            self._script_window = ScriptLossWindow(root, self._memory)  # type: ignore[arg-type]

    def _planning_step_plan(self, plan: Plan) -> Plan | None:
        """What the rest of the planning step runs instead of ``plan``, or None (``plan`` itself).
        Until the script's own part after the model's forward (its loss, or a second model's forward
        and backward) is measured on this step, the plan is charged an allowance for it; where the
        script holds more, this step alone would go over the budget (a second HF GPT-2 trained
        beside the first: 192.3 MiB of 185.7). So the rest of this step runs its blocks as the
        least-memory plan of the same profile does (the part outside them as the plan does), and the
        plan, solved again with the part as measured where it differs from the allowance, runs from
        the next step (``_before_step``). Only where that part is watched (``_watches_script_loss``)
        and the profile is this run's."""
        if not self._watches_script_loss() or self._charged.script_measured or self._from_file or self.reuse is not None:
            return None
        # the blocks as the least-memory plan runs them; the part outside them as the plan does (its
        # head and loss modes change what the script's loss holds, which this step measures for it)
        least = solve(plan.profile, minimum_peak(plan.profile))
        if least.choices == plan.choices:
            return None
        step_plan = Plan.from_choices(plan, least.choices, plan.outside)
        step_plan.notes.append("the planning step's rest: the blocks as the least-memory plan runs them, until "
                               "the script's own part is measured")
        return step_plan

    def _run_plan_from_now(self, root: nn.Module) -> None:
        """The planning step is over: the plan itself runs from this step on (its offload schedules,
        its part outside the regions, its step timer), where that step ran another (``_step_plan``)."""
        plan = self.plan
        self._step_plan = None
        assert plan is not None
        if self._outside != "keep":
            install_outside(root, "keep")
            self._outside = "keep"
        self._use_schedules(plan)
        if plan.outside != "keep":
            install_outside(root, plan.outside, self.prefetch, self._shared)
            self._outside = plan.outside
        if self.feedback and self.world == 1:
            self._timer = StepTimer(self)

    def _watches_script_loss(self) -> bool:
        """Whether the planning step's own loss is measured as the script continues (``script_loss``)."""
        return (self.loss_fn is None and not self.api and self.pipeline is None and self.world == 1
                and self._memory is not None and self._memory.available and self._memory.device.type == "cpu")

    def _take_baseline(self, device: torch.device) -> None:
        """The budget's baseline: what the process held on the model's ``device`` when the first
        planned step started (on a GPU, the caching allocator's reserved bytes: every later reading
        is of those, so ``_memory`` becomes that device's from here on)."""
        if self._start is not None:
            self._held_at_start = self._start.held or self._held_at_start
            self._start.stop()
            self._start = None
        if device.type == "cuda" and (self._memory is None or self._memory.device.type != "cuda"):
            self._memory = ProcessMemory(device, enabled=self.memory == "process")
        if device.type != "cpu":
            self._charged.loaded = 0  # host memory: not what a GPU budget (reserved bytes) counts
        held = self._held_at_start or {}
        if self._memory is not None and device_key(self._memory.device) in held:
            self._baseline = held[device_key(self._memory.device)]
        elif self._memory is not None and (self._baseline is None or device.type == "cuda"):
            self._baseline = _fresh_baseline(self._memory)  # the device's allocator started inside the step
        if not self._resident_at_start:
            self._resident_at_start = _status_bytes("VmRSS")
        if self._charged.file_start is None and self._memory is not None:
            self._charged.file_start = held.get("file", ProcessMemory("cpu").file_backed() if self._memory.available else 0)
        self._rank = rank()

    def _plan_later(self, stage: PipelineStage) -> None:
        """A pipeline stage that plans on its second microbatch (``pipelines``, SMP v1): the budget's
        baseline is this step's start; this microbatch's regions run holding least (``_least_options``)
        while the runner learns the shapes of the stage's calls."""
        if stage.stage > 0 and self._start is not None:
            # a serving stage's regions run in calls it serves, not inside one module call started this
            # microbatch, so the latest outermost module call may be far older: the baseline is now,
            # when its first call of the step runs (it holds that call's received arguments)
            self._start.stop()
            self._start = None
            self._held_at_start = held_now(self._memory or ProcessMemory("cpu", enabled=self.memory == "process"))
        self._take_baseline(device_of(stage.module))
        self.pipeline = stage
        self._position_key = stage.microbatch_key()
        self.mode = Mode.DEFERRED

    def _least_options(self) -> RegionOptions:
        """The region options holding least while no plan is made yet: recomputed, with the input
        offloaded where the choices offer it (``recompute+offload``), else recomputed."""
        tier = self.storage or "disk"
        least = [c for c in expand_choices(self.choices, (tier,)) if c.startswith("recompute+offload")]
        return choice_options(least[0]) if least else RegionOptions()

    def _announce(self, plan: Plan) -> None:
        """The log line (and picture) of a plan just made; after ``acshim plan``, its table, and the
        run ends here. Every rank has the same plan: rank 0 says it."""
        lead = (rank() == 0 or self.pipeline is not None) and not self.api  # each stage has its own plan
        if lead:
            print(self.summary(), file=sys.stderr, flush=True)
        if lead and self.png and not self.exit_after_plan:
            print(f"acshim: {write_picture(plan, self.png)}", file=sys.stderr, flush=True)
        if self.exit_after_plan:
            self.stop(keep_allocator=self.api)  # acshim.plan's steps run the plan on it
            if lead:
                print(self.report(), flush=True)
            raise PlanExit(0)

    def _explore(self, root: nn.Module, shapes: list[list[int]], now: bool = True) -> None:
        """Start planning a sharded model on its real steps: this one runs every region with the
        least memory (``lockstep.LockstepPlanner.base``) and is measured; the plan is solved when the next starts (``lockstep``). Not ``now``: a plan
        from a file runs, and only a step with larger inputs is explored."""
        memory = self._memory or ProcessMemory("cpu", enabled=self.memory == "process")  # the model's (_take_baseline)
        if self._baseline is None:
            self._baseline = _fresh_baseline(memory)
        self._planned_shapes = largest_inputs(self._planned_shapes, shapes)
        self._lockstep = LockstepPlanner(self, root, memory, self._baseline, explore=now)
        if now:
            self.mode, self.position = Mode.EXPLORE, 0

    def _lockstep_step(self, root: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        """A sharded model's step starts (every rank at once): take the plan the measured steps gave;
        a step with larger inputs than any planned for (on any rank) is explored again."""
        lockstep = self._lockstep
        assert lockstep is not None
        shapes = input_shapes(args, kwargs)
        first = self.plan is None
        refused = False
        try:
            plan = lockstep.step_started()
        except ValueError as error:
            if self.plan is not None and not self.api and lockstep.profile is not None:
                refused = True
                # explored again for larger inputs and refused: as _plan_again, the run goes on
                plan = lockstep.least_plan(self.plan)
                plan.notes.append(f"explored again for larger inputs and refused ({error}): the least-memory "
                                  "plan runs")
                if rank() == 0:
                    print(f"acshim: --budget {format_bytes(self.plan.budget)}: no plan fits the larger inputs "
                          f"explored: {error}; the run goes on under the least-memory plan ({plan.describe()}), "
                          "which may hold more than the budget on these inputs", file=sys.stderr, flush=True)
            else:
                self.stop()
                if self.api:
                    raise
                raise PlanExit(2, f"\nacshim run: --budget {self.budget}: {error}") from None
        if plan is not None:
            plan.profile.inputs = self._planned_shapes
            self.plan, self.mode = plan, Mode.PLANNED
            self._budget_bytes = plan.budget
            self._use_schedules(plan)
            if plan.outside != self._outside:  # the head and loss in chunks (lockstep.HEAD_MODE), or back
                self.run_outside(root, plan.outside, self._shared)
        if self.mode == Mode.EXPLORE:
            self._planned_shapes = largest_inputs(self._planned_shapes, shapes)
        elif agree_bytes(int(larger_inputs(shapes, self._planned_shapes)), device_of(root)):
            self._planned_shapes = largest_inputs(self._planned_shapes, shapes)
            if self._outside != "keep":  # explored as the model's own part outside the regions
                self.run_outside(root, "keep")
            lockstep.explore_again()
            self.mode = Mode.EXPLORE
            if rank() == 0 and not self.api:
                print(f"acshim: --budget {format_bytes(self.plan.budget)}: a rank's step inputs {shapes} are "  # type: ignore[union-attr]
                      f"larger than those planned for: this step runs every region {lockstep.base} and is measured, "
                      "as the steps after it, to plan again", file=sys.stderr, flush=True)
            return
        if lockstep.measuring is None and not lockstep.exploring:  # measured and verified: the plan runs
            self._cache_planned_steps()
        if plan is None or lockstep.verifications:  # none, or solved again after a verification step
            return
        if refused:  # said above; not saved to a plan file (it need not keep the budget)
            self.replans += 1
            return
        lead = rank() == 0 and not self.api
        if self.plan_file and lead:
            plan.save(self.plan_file)
        if not first:  # after a step with larger inputs
            self.replans += 1
            if lead:
                print(f"acshim: --budget {format_bytes(plan.budget)}: planned again for inputs {self._planned_shapes}: "
                      f"{self.summary(brief=True)}", file=sys.stderr, flush=True)
            return
        self._announce(plan)

    def _plan_on(self, root: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], shapes: list[list[int]]
                 ) -> None:
        """Plan on one step of ``root`` on ``args``/``kwargs`` (the model left as found)."""
        snapshot = ModelSnapshot(root)
        memory = self._memory or ProcessMemory("cpu", enabled=self.memory == "process")  # the model's (_take_baseline)
        # the budget stays above what the process held when the first planned step started (what
        # it has grown by since, code paged in, worker threads, is the run's and counts)
        if self._baseline is None:
            self._baseline = _fresh_baseline(memory)
        baseline = self._baseline
        self._charged.foreseen = self._foresee(root)  # before the parameters are aliased: optimizers hold the real ones
        try:  # profiling never reaches the real parameters, nor (replayed) another pipeline stage
            with _counters_paused(), parameters_aliased(root), _replaying(self.pipeline):
                self.plan = self._solve(root, args, kwargs, memory, baseline)
        except (BudgetTooSmall, ValueError) as error:
            snapshot.restore()
            self._drop_sites_data()
            if self.api:
                self.stop()
                if isinstance(error, (BudgetTooSmall, NoPlanMeasured)) and error.suggested:
                    error.args = (f"{error}; pass budget={error.suggested} ({format_bytes(error.suggested)}) or more"
                                  + (f" ({error.why})" if getattr(error, "why", "") else "")
                                  + (', or memory="tensors" to budget activation tensors alone'
                                     if self.memory == "process" else ""),)
                raise
            suggested = error.suggested if isinstance(error, (BudgetTooSmall, NoPlanMeasured)) else 0
            why = getattr(error, "why", "") if isinstance(error, (BudgetTooSmall, NoPlanMeasured)) else ""
            if suggested and self.pipeline is not None:  # the rank's budget: its schedule's part and each alive
                held = self._share.held.total if self._share is not None else 0
                suggested = self.pipeline.in_flight * suggested + held
                error = ValueError(f"{self.pipeline.describe()}: the schedule holds {format_bytes(held)} besides; "
                                   f"one microbatch: {error}")
            hint = (f"; pass --budget {budget_at_least(suggested)} or more" + (f" ({why})" if why else "")
                    if suggested else "")
            if self._replanning:  # a plan made again at a step's start: the run goes on (_plan_again)
                raise _PlanRefused(f"{error}{hint}") from None
            self.stop()
            raise PlanExit(2, f"\nacshim run: --budget {self.budget}: {error}{hint}") from None
        except BaseException:
            snapshot.restore()
            self._drop_sites_data()
            self.stop()
            raise
        snapshot.restore()
        self._drop_sites_data()
        self._planned_shapes = largest_inputs(self._planned_shapes, shapes)
        self.plan.profile.inputs = shapes  # type: ignore[union-attr]
        self._charged.solved(root, self._charged.paged)

    def _solve(self, root: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], memory: ProcessMemory,
               baseline: int) -> Plan:
        fraction = budget_fraction(self.budget)
        limit = self._budget_bytes if self._budget_bytes is not None else (
            None if fraction is not None else parse_budget(self.budget, 1))
        profiler = RegionProfiler(self, root, args, kwargs, self.loss_fn, memory, baseline, limit,
                                  self._guard_file_baseline())
        self._profiler = profiler
        try:
            with profiler:
                # a BetweenBudget's bytes are unknown until full recompute's peak is: the guards while
                # profiling stop at no checkpointing's peak, the plan is solved and verified within it
                guard = 1.0 if isinstance(self.budget, BetweenBudget) else fraction
                profile = self.reuse if self.reuse is not None else self._profile(root, profiler, guard, limit)
                fractional = limit is None and fraction is not None
                if self.reuse is None:  # no checkpointing's whole step holds them too (_base_besides)
                    self._base_besides = self._besides(root, profiler)
                if fractional:
                    limit = self._stage_share(_fraction_in_bytes(self.budget, profile, profiler.used(),
                                                                 self._base_besides), fraction)
                profiler.set_limit(limit)
                if profiler.pending():
                    _measure_within_reach(profile, profiler, limit)
                    if fractional:  # no checkpointing's peak as estimated with them (plan files check it)
                        limit = self._stage_share(_fraction_in_bytes(self.budget, profile, profiler.used(),
                                                                     self._base_besides), fraction)
                        profiler.set_limit(limit)
                # the counting forward went over the budget (counted again within a larger bound): no
                # plan may run, the planning step has held more than the budget
                counted_over = (self._count_refusal is not None and isinstance(limit, int) and
                                profiler.reached.get("count", 0) + self._paged_in() > guard_limit(limit))
                # a region no choice of which could be measured within the budget: no plan exists, and
                # the refusal measures it within a larger budget (Refusal.measure_stopped) on its captured inputs
                remeasure = counted_over or (isinstance(limit, int) and self._measures_for_refusals() and
                                             any(not any(feasible(b, c) for c in b.held) for b in profile.blocks))
                if not remeasure:
                    profiler.drop_copies()

                def measure(candidate: Plan) -> Verification:
                    found = profiler.verify(candidate.choices, candidate.outside, candidate.in_flight)
                    return agree_measurement(found, device_of(root)) if self._agreed() else found

                overhead = profiler.used()
                if self._agreed():  # every rank solves the same numbers
                    overhead = agree_bytes(overhead, device_of(root))
                # the script's own loss beyond the planning loss's (measured on the planning step): the
                # verification runs the planning loss, so it is verified within the budget less it;
                # and the code the step paged in, which the verification's reading leaves out
                ledger = self._charged
                if not ledger.script_measured and self._watches_script_loss():
                    ledger.script_part = profiler.script_loss or 0  # until the planning step measures it
                paged = self._paged_in()
                if self._agreed():
                    paged, ledger.foreseen = agree_bytes(paged, device_of(root)), agree_bytes(ledger.foreseen,
                                                                                              device_of(root))
                charges = ledger.charges(paged)
                least = least_budget(profile, overhead, profiler.needed_for if self.reuse is None else None,
                                     guarded_budget)
                refusal = Refusal(profile, profiler, limit, charges, least, overhead, measure, self.retries,
                                  self._measures_for_refusals(), self.verify)
                reserve = refusal.reserve
                try:
                    if counted_over:
                        raise self._count_refusal  # type: ignore[misc]
                    # no offload probe yet (probe.py): what its step leaves resident is not charged
                    result = solve_within(profile, max(1, limit - reserve) if reserve else limit,
                                          measure if self.verify else None, retries=self.retries, overhead=overhead)
                except BudgetTooSmall as error:
                    refusal.too_small(error, counted_over)
                    raise
                except NoPlanMeasured as error:  # the least plan measured over: its measurement names the budget
                    refusal.none_measured(error)
                    raise
                result.least_budget = least + reserve if least else least
                ledger.paged = paged
                result.reference_peak += self._base_besides
                if reserve:
                    result.budget = limit
                    charges.charge(result)
        finally:
            self._profiler = None
            self.mode = Mode.IDLE if self.plan is None else Mode.PLANNED
        if result.profile.unmeasured:
            result.notes.append(f"not measured, as no plan within {1 - REACH:.0%} of the budget would take them: "
                                f"{', '.join(result.profile.unmeasured)} (frontier() leaves them out)")
        self._budget_bytes = result.budget
        return result

    def _besides(self, root: nn.Module, profiler: RegionProfiler) -> int:
        """What the step holds besides its activations as it is profiled (``_base_besides``), the
        same on every rank that plans with others."""
        script = self._charged.script_part if self._charged.script_measured else (
            (profiler.script_loss or 0) if self._watches_script_loss() else 0)
        trim()  # not what the last measurement freed (a GPU's caching allocator keeps it reserved)
        besides = profiler.used() + self._paged_in() + self._charged.foreseen + script
        return agree_bytes(besides, device_of(root)) if self._agreed() else besides

    def _measures_for_refusals(self) -> bool:
        """Whether a refusal may measure beyond the budget to name the frontier's least budget: one
        process planning alone, on a profile of its own (ranks planning together, whose measurements
        run in lock-step, and pipeline stages refuse with the bound)."""
        return self.reuse is None and not self._agreed() and self.pipeline is None

    def _stage_share(self, limit: int, fraction: float | None) -> int:
        """A fractional budget's ``limit`` (that share of one microbatch's step without checkpointing)
        as one microbatch's share of the rank's on a pipeline stage (``StageShare.of_fraction``)."""
        return self._share.of_fraction(limit, fraction) if self._share is not None and fraction is not None else limit

    def _profile(self, root: nn.Module, profiler: RegionProfiler, fraction: float | None,
                 limit: int | None) -> Profile:
        # 0. a fractional budget: a lower bound of its bytes before anything real runs
        least = 0
        if limit is None and fraction is not None:
            fake = step_peak(self, root, profiler.args, profiler.kwargs, profiler.loss_fn)
            if fake is not None:  # below no checkpointing's peak however counted (FAKE_PEAK_SHARE)
                least = int(fraction * max(fake.forward, FAKE_PEAK_SHARE * fake.peak))
                self._fake_peak = fake.peak
        # 1. count what the model saves, capture the distinct regions' inputs
        self._count_refusal = None
        try:
            if least:
                profiler.set_limit(least, bound=True)
            profiler.count(fraction if limit is None and not least else None)
        except OverBudget as error:
            refusal = BudgetTooSmall.forward_alone(self.budget, error, self._fake_peak, profiler.used())
            release_stopped(error)
            if not self._measures_for_refusals():
                raise refusal from None
            # Stopped at a lower bound of the budget (a fraction's, before no checkpointing's peak is
            # measured) or at the budget, where offloading could still hold less than this forward:
            # counted again within what the refusal would name and profiled; the solve refuses only
            # if this forward went over the budget as it is then known (``_solve``), naming the
            # frontier's least budget.
            profiler.set_limit(refusal.suggested)
            try:
                profiler.count(None)
            except OverBudget as error:
                release_stopped(error)
                raise refusal from None
            self._count_refusal = refusal
            if limit is not None:  # what follows is measured within the budget again
                profiler.set_limit(limit)
            elif least:
                profiler.set_limit(least, bound=True)
        if not self.sites:
            raise ValueError("the model's step ran no checkpointed region")
        counted = profiler.counted
        if limit is None and fraction is not None:
            profiler.fraction_limit_for_outside(fraction, least)
        names = site_names(root, self.sites)
        for name, site in zip(names, self.sites, strict=True):
            site.name = name
        self.names = names
        tiers = (self.storage,) if self.storage else (("disk",) if device_of(root).type == "cpu" else ("host",))
        choices = expand_choices(self.choices, tiers)
        if "recompute" not in choices:
            choices.append("recompute")
        if any(site.as_asked for site in self.sites):  # their only choice (choices.ASKED)
            choices.append(ASKED)
        # 2. the part outside the regions, alone (regions replayed): kept, and offloaded per tier
        # (a model that is itself a region has no outside part)
        parts = outside_choices(root, choices) if checkpointed_forward_of(root) is None else ["keep"]
        later = [part for part in parts if self._defer() and split_outside(part)[1] is not None]
        outside = {part: profiler.outside(part) for part in parts if part not in later}
        profiler.defer_outside(outside, later)
        kept = outside.pop("keep")
        if limit is None and fraction is not None and kept["held"] < INFEASIBLE:
            # closer to no checkpointing's peak: every region's saved bytes held while the head's
            # backward runs (what keeping every block would hold then)
            regions = sum(site.saved for site in self.sites)
            profiler.set_limit(max(least, int(fraction * (kept["held"] + regions + kept["transient"]))))
        # 3. each distinct region alone, per choice
        blocks = profiler.regions(choices, names, defer=self._defer())
        root.zero_grad(set_to_none=True)
        profile = Profile(
            blocks=blocks, choices=choices, other_held=int(kept["held"]), other_transient=int(kept["transient"]),
            other_seconds=kept["seconds"], other_back=int(kept.get("back", kept["held"])),
            signature=model_signature(root, [(n, s.owner if s.owner is not None else root)
                                             for n, s in zip(names, self.sites, strict=True)]),
            prefetch=self.prefetch, method=METHOD, outside=outside, other_saved=counted.bytes.get(-1, 0),
            stops=dict(profiler.stops), unchecked_floor=int(FAKE_PEAK_SHARE * self._fake_peak),
            copies_outlive_blocks=copies_outlive_blocks(choices, device_of(root)),
            recompute_step={"saved": counted.total(),
                            "forward_seconds": sum(site.forward_seconds for site in self.sites)})
        if self._agreed():  # every rank solves the same numbers, so every rank gets the same plan
            profile = agree_profile(profile, device_of(root))
            profile.method += f"; agreed across {self.world} ranks (each number the largest any rank measured)"
        return profile

    def _defer(self) -> bool:
        """Whether choices that bounding ones make unlikely may go unmeasured (``profiler.DEFERRED``):
        not where the whole frontier is shown (``sweep``, ``png``), nor across ranks (each rank
        would have to measure the same ones in lock-step)."""
        return not (self.sweep or self.png or self._agreed())

    def _agreed(self) -> bool:
        """Whether the ranks plan together (one plan); a pipeline stage plans alone."""
        return self.world > 1 and self.pipeline is None

    @property
    def stage_budget(self) -> int | None:
        """The bytes this rank may use above its first step's start: the plan's budget, or on a
        pipeline stage the rank's (``StageShare.budget``)."""
        if self.plan is None:
            return None
        return self.plan.budget if self.pipeline is None else self._stage().budget(self.plan)

    @property
    def stage_predicted(self) -> int | None:
        """A pipeline rank's predicted peak above its first step's start (``StageShare.predicted``)."""
        return None if self.plan is None or self.pipeline is None else self._stage().predicted(self.plan)

    def rank_summary(self) -> str | None:
        """A pipeline rank's line at the end of the run: its budget, predicted and measured peak
        (``VmHWM`` above ``VmRSS`` when the first step's baseline was read: the process's own
        high-water mark, so anything higher before that step would show too)."""
        if self.plan is None or self.pipeline is None:
            return None
        measured = max(0, _status_bytes("VmHWM") - self._resident_at_start) if self._resident_at_start else 0
        return self._stage().ended(self.plan, self._rank, measured)

    def _stage(self) -> StageShare:
        """This pipeline rank's share (an SMP v1 stage that never planned: its schedule holds nothing known)."""
        assert self.pipeline is not None
        return self._share if self._share is not None else StageShare(self.pipeline, ScheduleHeld([]))

    def _drop_sites_data(self) -> None:
        for site in self.sites:
            site.captured = None

    def _use_plan_file(self, root: nn.Module, shapes: list[list[int]]) -> None:
        """The plan saved in ``plan_file`` by an earlier run, checked against this model, batch and budget."""
        try:
            self.plan = load_plan_file(self.plan_file, root, self.budget, shapes)  # type: ignore[arg-type]
        except (PlanFileMismatch, ValueError, OSError) as error:
            self.stop()
            if self.api:
                raise
            raise PlanExit(2, f"\nacshim run: --plan-file {self.plan_file}: {error}") from None
        self._budget_bytes = self.plan.budget
        if self._share is not None and self.plan.rank_budget:
            self._share.rank_budget = self.plan.rank_budget
        self._planned_shapes = self.plan.profile.inputs or shapes
        self.names = list(self.plan.blocks)
        self._from_file = True

    def _replan(self, root: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], shapes: list[list[int]]) -> None:
        """Plan again, before this step's forward, on its larger inputs (within the same bytes)."""
        previous = self.plan
        assert previous is not None
        self._drop_plan(root)
        self.sites = []
        self.reuse = None
        planned = self._plan_again(root, args, kwargs, shapes, previous,
                                   f"this step's inputs {shapes} are larger than those planned for "
                                   f"{previous.profile.inputs}")
        plan = self._run_new_plan(root)
        if planned and rank() == 0 and not self.api:
            before = previous.profile.inputs if previous is not None else []
            print(f"acshim: --budget {format_bytes(plan.budget)}: this step's inputs {shapes} are larger than those "
                  f"planned for {before}: planned again before it ran: {self.summary(brief=True)}",
                  file=sys.stderr, flush=True)
        if self.feedback and self.world == 1:
            self._timer = StepTimer(self)

    def _plan_again(self, root: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], shapes: list[list[int]],
                    previous: Plan, why: str) -> bool:
        """``_plan_on`` for a plan made again at a step's start (``why``); True where it planned. A
        re-plan never ends a run its last plan (``previous``) kept within budget: where it is refused,
        the run goes on under the least-memory plan of ``previous``'s profile (the frontier's start,
        the least any plan of these choices holds), said on stderr with the budget the refusal names;
        the inputs it was refused for count as planned for (no step re-plans for them again)."""
        self._replanning = True
        try:
            self._plan_on(root, args, kwargs, shapes)
            return True
        except _PlanRefused as refused:
            least = solve(previous.profile, minimum_peak(previous.profile))
            plan = Plan.from_choices(previous, least.choices, least.outside)
            plan.notes.append(f"made again ({why}) and refused ({refused}): the least-memory plan of the last "
                              "profile runs")
            self.plan = plan
            self._planned_shapes = largest_inputs(self._planned_shapes, shapes)
            if rank() == 0:
                print(f"acshim: --budget {format_bytes(previous.budget)}: {why}, and no plan was measured within the "
                      f"budget for them: {refused}; the run goes on under the least-memory plan of the last profile "
                      f"({plan.describe()}), which may hold more than the budget on these inputs", file=sys.stderr,
                      flush=True)
            return False
        finally:
            self._replanning = False

    def _drop_plan(self, root: nn.Module) -> None:
        """Before a plan is made again at a step's start: the current one stops (its timer, its part
        outside the regions back to kept, its shared offload schedules)."""
        self.mode, self.plan = Mode.IDLE, None
        if self._timer is not None:
            self._timer.stop()
            self._timer = None
        if self._outside != "keep":
            install_outside(root, "keep")
            self._outside = "keep"
        self._shared = {}

    def _run_new_plan(self, root: nn.Module) -> Plan:
        """After a plan made again at a step's start: count it, run it from this step on (its
        schedules, its part outside the regions) and return it."""
        self.replans += 1
        self.mode = Mode.PLANNED
        plan = self.plan
        assert plan is not None
        self._use_schedules(plan)
        if plan.outside != "keep":
            install_outside(root, plan.outside, self.prefetch, self._shared)
            self._outside = plan.outside
        return plan

    def _charge_script_part(self, root: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], needed: int
                            ) -> None:
        """The planning step's own loss and backward held ``needed`` bytes above the forward's end
        (``script_loss``); beyond what the planning loss needed there (the profile's transient of the
        part outside the regions), they are charged once: where they differ from what was charged
        before they were measured (``script_loss_allowance``), the plan is solved again (its measured
        profile reused) within the budget less them, and verified, before this step runs."""
        plan = self.plan
        assert plan is not None
        own = plan.profile.other(plan.outside)[1] if plan.outside in plan.profile.outside_choices() else 0
        resolution = max(unit_of(plan.profile), plan.budget // 100)  # what a measurement resolves
        extra = needed - own if needed - own > resolution else 0
        charged = self._charged.script_measured_as(extra, resolution)
        if charged is None:
            return
        self.reuse = plan.profile
        self._drop_plan(root)
        try:
            planned = self._plan_again(root, args, kwargs, input_shapes(args, kwargs), plan,
                                       f"the script's own loss and its backward held {format_bytes(needed)} above "
                                       f"the model's forward end, {format_bytes(extra)} more than the planner's loss")
        finally:
            self.reuse = None
        found = self._run_new_plan(root)
        if planned and rank() == 0:
            print(f"acshim: --budget {format_bytes(found.budget)}: the script's own loss and its backward held "
                  f"{format_bytes(needed)} above the model's forward end, {format_bytes(extra)} more than the "
                  f"planner's loss{f' ({format_bytes(charged)} charged before it was measured)' if charged else ''}: "
                  f"charged, solved again: {self.summary(brief=True)}", file=sys.stderr, flush=True)
        if self.feedback and self.world == 1:
            self._timer = StepTimer(self)

    def _charge_training_state(self, root: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A step that starts holding more gradients and optimizer state than the plan in force was
        solved with (``training_state``: counted from the tensors), by more than the room its
        prediction left under the budget, has the plan solved again first, with what the process
        holds now; at most ``ledger.MAX_STATE_RESOLVES`` times a run. Single-process plans: ranks that plan
        together, pipeline stages and plan files keep theirs."""
        plan = self.plan
        if plan is None or self.api or self.world != 1 or self.pipeline is not None or self.memory != "process":
            return
        growth = self._charged.grown(root, plan, self._paged_in())
        if growth is None:
            return
        self.resolve(plan.profile, growth.why(), args, kwargs)
        # refused too: not tried again for what it could not fit
        self._charged.state, self._charged.paged = growth.now, self._paged_in()

    def _foresee(self, root: nn.Module) -> int:
        """The optimizer state a first ``step()`` will make for ``root``'s parameters (charged to the
        plan ahead of it: ``training_state.foreseen_optimizer_state``); 0 for tensor budgets and
        pipeline stages."""
        if self.memory != "process" or self.pipeline is not None:
            return 0
        return foreseen_optimizer_state(root, self._charged.watch)

    def _guard_file_baseline(self) -> int | None:
        """What the guards count code paged in from (``Guard.file_baseline``), where it is charged."""
        memory = self._memory
        if (memory is None or not memory.available or memory.device.type != "cpu" or self.pipeline is not None
                or self._charged.file_start is None):
            return None
        return self._charged.file_start

    def _paged_in(self) -> int:
        """File-backed pages (library code, mapped files) the process paged in since the first
        planned step started: the verification's reading (anonymous memory) leaves them out, and
        they stay resident for the rest of the run, where ``VmHWM`` counts them (0 on a GPU, for
        tensor budgets and for pipeline stages, whose budget is checked by ``VmHWM`` already)."""
        start = self._guard_file_baseline()
        return 0 if start is None else max(0, self._memory.file_backed() - start)  # type: ignore[union-attr]

    def resolve(self, profile: Profile, why: str, args: tuple[Any, ...] | None = None,
                kwargs: dict[str, Any] | None = None) -> bool:
        """Solve ``profile`` (measured costs) again at the same budget and, if that gives another plan,
        verify it on one step of the model (on ``args``/``kwargs``, else the step the timer holds)
        before the next step runs; True if the plan changed."""
        plan = self.plan
        root = self.root
        assert plan is not None and root is not None
        if args is None:
            args, kwargs = self._timer.args, self._timer.kwargs  # type: ignore[union-attr]
        memory = self._memory or ProcessMemory("cpu", enabled=self.memory == "process")
        snapshot = ModelSnapshot(root)
        sessions = self._shared
        foreseen = self._foresee(root)
        charges = Charges(self._charged.script_part, self._paged_in(), foreseen, self._charged.loaded)  # as _solve
        reserve = charges.reserve()
        try:
            with _counters_paused(), parameters_aliased(root):
                profiler = RegionProfiler(self, root, args, kwargs or {}, self.loss_fn, memory,
                                          self._baseline or _fresh_baseline(memory), plan.budget,
                                          self._guard_file_baseline())
                self._profiler = profiler
                # what the allocators keep free is not held besides: on a GPU the caching allocator
                # still reserved the last step's activations (1.29 GiB read as held on an H200,
                # where the step held its 420 MiB of gradients and 180 MiB more)
                trim()
                with profiler:
                    found = solve_within(profile, max(1, plan.budget - reserve),
                                         lambda candidate: profiler.verify(candidate.choices, candidate.outside,
                                                                            candidate.in_flight),
                                         retries=self.retries, overhead=profiler.used(), skip=(plan.choices, plan.outside))
                found.reference_peak += self._base_besides
                if reserve:
                    found.budget = plan.budget
                    charges.charge(found)
        except (BudgetTooSmall, ValueError) as error:
            found, refused = None, error
            if reserve and isinstance(error, BudgetTooSmall):
                error.args = (f"{format_bytes(plan.budget)} less {format_bytes(reserve)} charged besides the "
                              f"measurement ({charges}) leaves {error}",)
        else:
            refused = None
        finally:
            self._profiler = None
            snapshot.restore()
            self.mode = Mode.PLANNED
            self._shared = sessions
        changed = found is not None and (found.choices, found.outside) != (plan.choices, plan.outside)
        if changed and found is not None:
            found.notes.append(f"re-solved after planning: {why}")
            if self._outside != "keep":
                install_outside(root, "keep")
                self._outside = "keep"
            self.plan = found
            self._use_schedules(found)
            if found.outside != "keep":
                install_outside(root, found.outside, self.prefetch, self._shared)
                self._outside = found.outside
        else:
            plan.profile = profile
            if found is not None:  # the same plan: its prediction now with what is held besides now
                plan.overhead = found.overhead
        if found is not None:  # what the plan in force was solved with
            self._charged.foreseen = foreseen
            self._charged.solved(root, charges.paged)
        if rank() == 0 and not self.api:
            if changed:
                outcome = f"now {self.summary(brief=True)}"
            elif refused is not None:
                # solved within the budget less the script's loss: the budget to pass has it back
                least = (f"; the least budget that plans it: {format_bytes(refused.suggested + reserve)}"
                         if isinstance(refused, BudgetTooSmall) and refused.suggested else "")
                outcome = f"kept the plan, as none was found within the budget ({refused}){least}"
            else:
                outcome = "kept the plan"
            print(f"acshim: --budget {format_bytes(plan.budget)}: {why}; solved again with the measured costs: "
                  f"{outcome}", file=sys.stderr, flush=True)
        return changed

    # ---------------------------------------------------------------------------------- reporting
    def summary(self, brief: bool = False) -> str:
        """The one log line: what the plan replaced (``report.plan_line``)."""
        assert self.plan is not None
        reused = self.plan_file if self._from_file else None
        if brief:
            return plan_line(self.plan, self.sites, brief=True, reused_from=reused)
        if self.pipeline is not None:
            return self._stage().planned(self.plan, rank(), f"{plan_replacing(self.plan, self.sites)}; "
                                                            f"{plan_outcome(self.plan, reused)}")
        return plan_line(self.plan, self.sites, reused_from=reused)

    def report(self) -> str:
        """``acshim plan``'s output: the plan table, with ``sweep`` the frontier and baselines."""
        plan = self.plan
        assert plan is not None
        lines = [str(plan)]
        if self.sweep:
            lines += ["", frontier_table(plan)]
            if self.png:
                lines.append(write_picture(plan, self.png))
        return "\n".join(lines)


def _offload_rest_of_forward(root: nn.Module, scope: SharedOffload) -> None:
    """The interrupted step's forward began before the plan offloaded the part outside the regions:
    enter that scope now, for the rest of this forward (the head and loss), and leave it when the
    model's forward returns, so this step holds no more than the plan verified."""
    scope.__enter__()
    handles: list[Any] = []

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        handles.pop().remove()
        scope.__exit__(None, None, None)

    handles.append(root.register_forward_hook(leave, always_call=True))


REACH = 0.85
"""Deferred choices are measured when a plan solved at the budget, or at this share of it (where
re-solves after a verification over budget go), would use them."""


def _measure_within_reach(profile: Profile, profiler: RegionProfiler, limit: int) -> None:
    """Measure the choices ``profiler`` deferred that a plan within reach could use: solve on their
    lower bounds (``RegionProfiler.optimistic``) at the first target ``solve_within`` will try and
    at ``REACH`` of it; each deferred choice the fastest solution takes is measured and the solve
    repeated.
    A budget no plan meets measures them all (the least achievable peak is then exact). Those left
    stay out of this profile (``Profile.unmeasured``)."""
    target = int(limit * (1 - HEADROOM)) - profiler.used()
    for share in (1.0, REACH):
        while profiler.pending():
            found = fastest(profiler.optimistic(profile), int(share * target))
            if found is None:
                profiler.measure_pending(profile)
                break
            wanted = {*found.choices, found.outside} & profiler.pending()
            if not wanted:
                break
            profiler.measure_pending(profile, wanted)
    profile.unmeasured = sorted(profiler.pending())


def _fraction_in_bytes(budget: Any, profile: Profile, overhead: int = 0, besides: int = 0) -> int:
    """A fractional budget in bytes: that share of no checkpointing's peak as the profile estimates it
    (a ``BetweenBudget``: that share of the way from full recompute's predicted peak to it, plus
    ``overhead``, what the process holds besides the activations: torch's budget counts activations
    only, and full recompute, its 0.0, must stay reachable). A plain fraction is of that peak with
    what the step holds ``besides`` its activations (``PlanSession._base_besides``): ``VmHWM`` counts
    them, with checkpointing and without, and a plan's predicted whole step has them."""
    none = reference(profile)[0] or profile.recompute_step.get("peak", 0)
    if isinstance(budget, BetweenBudget):
        full = rounded_peak(profile, profile.uniform("recompute")) if "recompute" in profile.choices else 0
        return budget.between(full if full < INFEASIBLE else 0, int(none)) + overhead
    return parse_budget(budget, none + besides)


def _status_bytes(field: str) -> int:
    """A ``/proc/self/status`` size (``VmRSS``, ``VmHWM``) in bytes, or 0 where there is none."""
    try:
        with open("/proc/self/status") as status:
            return next((int(line.split()[1]) * 1024 for line in status if line.startswith(field + ":")), 0)
    except OSError:
        return 0


def _stage_output_bytes(session: PlanSession, stage: PipelineStage, args: tuple[Any, ...],
                        kwargs: dict[str, Any]) -> int:
    """One microbatch's output bytes of a pipeline stage module: torch's ``PipelineStage`` knows its
    outputs' shapes (``get_outputs_meta``, from its shape inference); else the module runs once on
    fake tensors (nothing allocated, regions as plain calls); else its inputs' bytes."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_flatten, tree_map

    from .pipelines import tensor_bytes

    def size(value: Any) -> int:
        return sum(t.numel() * t.element_size() for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))

    meta = getattr(stage.owner, "_outputs_meta", None)
    if meta is not None:
        return size(meta)
    position = session.position
    # a fake forward still runs some in-place updates of real state for real (BatchNorm's 0-dim
    # num_batches_tracked, measured): the stage's buffers and attributes are put back after it
    snapshot = ModelSnapshot(stage.module)
    try:  # the script's RNG and region counts stay as they were
        with _counters_paused(), torch.random.fork_rng(devices=[]), FakeTensorMode(allow_non_fake_inputs=True) \
                as mode, torch.no_grad():
            fake_args, fake_kwargs = tree_map(lambda v: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v,
                                              (args, kwargs))
            with session.routing(Mode.PLAIN):
                return size(stage.module(*fake_args, **fake_kwargs))
    except Exception:  # a forward that depends on values, or an operator without a fake kernel
        return tensor_bytes((args, kwargs))
    finally:
        snapshot.restore()
        session.position = position


def _fresh_baseline(memory: ProcessMemory) -> int:
    trim()
    return memory.current()


@contextlib.contextmanager
def _replaying(stage: PipelineStage | None) -> Iterator[None]:
    """While planning an SMP v1 stage, its runner replays calls to other stages (``pipelines``)."""
    runner = stage.owner if stage is not None and stage.microbatch_key is not None else None
    if runner is None:
        yield
        return
    runner.replaying = True
    try:
        yield
    finally:
        runner.replaying = False


@contextlib.contextmanager
def _counters_paused() -> Iterator[None]:
    """Planning's own region runs stay out of ``STATS`` and ``--report``."""
    stats = engine.STATS
    forwards, recomputes, recorder = stats.forwards, stats.recomputes, stats.recorder
    if recorder is not None:
        recorder.paused = True
    stats.recorder = None
    try:
        yield
    finally:
        stats.forwards, stats.recomputes, stats.recorder = forwards, recomputes, recorder
        if recorder is not None:
            recorder.paused = False

