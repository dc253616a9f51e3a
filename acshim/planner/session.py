"""``acshim run --budget`` and ``acshim plan``: an unchanged script's own checkpoint calls get the plan.

Design. Every dialect's checkpoint call reaches the engine's ``run_region``; while a ``PlanSession``
is active (``acshim.region.ROUTERS``) ``run_region`` hands the call to ``PlanSession.route`` instead.
Regions are keyed by their **position in the step**: the model's forward pre-hook resets the count,
so a DeepSpeed closure, a ``checkpoint_wrapper`` module or a Hugging Face layer are all "region i".

The first region call of the script's first step plans, there and then, within the budget:
1. the model being run is the outermost ``nn.Module`` call on the stack (data-parallel wrappers
   skipped), with the inputs it was called with;
2. one step of that model runs with every region fully recomputed, under the live-bytes tracker: it
   captures each region's inputs and output (the whole model never runs without checkpointing);
   what lies outside the regions is then measured alone, each region replaying its recorded output
   (``replay``): kept, and per offload tier offloaded;
3. each region runs alone per choice on its captured inputs (``acshim.plan``'s block profile);
4. ``solve_within`` solves exactly and verifies on one more step, re-solving if measured over budget;
5. gradients, RNG state and buffers are put back, and the interrupted step continues under the
   plan: region i runs as keep (a plain call), selective, recompute, offload or recompute+offload,
   whatever the script asked for; an offloaded outside part gets its scope around the model's
   forward from the next step on. One line on stderr says what was replaced.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .. import region as engine
from .. import structures
from ..head import planning_loss
from ..options import RegionOptions
from ..region import _owning_module, run_region_now
from ..region_state import region_inputs
from ..storage import no_offload
from ..wrap import checkpointed_forward_of
from .agree import agree_measurement, agree_profile
from .aliases import parameters_aliased
from .budget import budget_at_least, format_bytes, parse_budget
from .choices import (
    BASE_CHOICES,
    SharedOffload,
    choice_options,
    expand_choices,
    install_outside,
    is_offload,
    outside_choices,
)
from .plan import Plan, solve_within
from .profile import (
    BlockProfile,
    Profile,
    _block_key,
    _err_high,
    _grad_flags,
    _timed,
    measure_choice,
    model_signature,
)
from .replay import Copies, recorded_keys, replay
from .snapshot import ModelSnapshot
from .solver import BudgetTooSmall
from .tracker import LiveBytes, excluded_keys, grad_keys

METHOD = ("measured on the script's first step: one step of the model with every region fully recomputed "
          "captured each region's input and output, the rest of the model ran alone (regions replayed), kept and "
          "offloaded, then each region ran alone per choice (offload: two copies through one shared schedule)")

_WRAPPERS = ("DistributedDataParallel", "DataParallel", "DeepSpeedEngine", "FullyShardedDataParallel",
             "DistributedModel", "PipelineModule")


class PlanExit(BaseException):
    """Ends the script from inside its first step: ``code`` 0 after ``acshim plan``, 2 on bad input
    or a budget that cannot be met (``message`` says which argument and how to fix it)."""

    def __init__(self, code: int, message: str = "") -> None:
        super().__init__(message)
        self.code, self.message = code, message


@dataclass
class RegionSite:
    """Region i of the step: the callable the script checkpointed and what it asked for."""

    function: Callable[..., Any]
    owner: nn.Module | None
    dialect: str
    asked: str
    captured: tuple[Any, Any, list[bool]] | None = None
    recorded: Any = None
    """Its output in the profiling step (copies), replayed while the rest of the model is measured."""
    options: RegionOptions | None = None
    calls: int = 0


@dataclass
class PlanSession:
    """The router ``acshim run --budget`` installs (see the module docstring)."""

    budget: int | float | str
    choices: tuple[str, ...] = BASE_CHOICES
    storage: str | None = None
    prefetch: int = 2
    repeats: int = 2
    exit_after_plan: bool = False
    sweep: bool = False
    png: str | None = None
    mode: str = "idle"  # idle -> capture / recompute / measure (while planning) -> planned
    position: int = 0
    sites: list[RegionSite] = field(default_factory=list)
    plan: Plan | None = None
    root: nn.Module | None = None
    names: list[str] = field(default_factory=list)
    _handle: Any = None
    _candidate: list[str] | None = None
    _head_marked: Callable[[], None] | None = None
    _shared: dict[str, SharedOffload] = field(default_factory=dict)
    world: int = 1
    _planned_elements: int = 0
    _larger_elements: int = 0
    """Elements of this step's inputs when more than planned on (0 otherwise)."""
    _warned_larger: bool = False
    _copies: Copies = field(default_factory=Copies)
    _outside: str = "keep"
    """How the part of the model outside the regions runs now (the plan's, or a candidate's)."""

    # ---------------------------------------------------------------------------------- lifetime
    def start(self) -> PlanSession:
        """Check the arguments and route every region call to this session."""
        _check_budget(self.budget)
        expand_choices(self.choices, ("disk",))
        engine.ROUTERS.append(self)
        return self

    def stop(self) -> None:
        """Stop routing; regions run as the script asked again."""
        if self in engine.ROUTERS:
            engine.ROUTERS.remove(self)
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self.root is not None and self._outside != "keep":
            install_outside(self.root, "keep")  # the model's own forward back
            self._outside = "keep"

    # ---------------------------------------------------------------------------------- routing
    def route(self, function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
              options: RegionOptions) -> Any:
        if self.mode == "idle":
            self._plan_now(function, args, kwargs, options)
        index = self.position
        self.position += 1
        if self.mode == "capture":
            return self._capture(index, function, args, kwargs, options)
        if self.mode == "replay" and index < len(self.sites):
            return self._mark_head(replay(self.sites[index].recorded, args, kwargs))
        if self.mode in ("recompute", "replay"):
            return self._mark_head(run_region_now(function, args, kwargs, RegionOptions()))
        choices = self._candidate if self.mode == "measure" else self.plan.choices  # type: ignore[union-attr]
        if choices is None or index >= len(choices) or index >= len(self.sites):
            return run_region_now(function, args, kwargs, RegionOptions())  # more regions than planned: safe
        self.sites[index].calls += 1
        output = self.run_choice(self.sites[index], choices[index], function, args, kwargs)
        if self._larger_elements and not self._warned_larger:
            self._warn_in_backward(output)
        return output

    def run_choice(self, site: RegionSite, choice: str, function: Callable[..., Any], args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> Any:
        """Run one region call as ``choice``."""
        base, _, tier = choice.partition(":")
        if base == "keep":
            engine.STATS.forward(function)
            if self._outside != "keep":  # the model around it is offloaded: a kept region is not
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
        if site.options is None or getattr(site, "_choice", None) != choice:
            site.options, site._choice = choice_options(choice), choice  # type: ignore[attr-defined]
        if self._outside != "keep" and base != "recompute+offload":  # as for keep: not offloaded
            with no_offload():
                return run_region_now(function, args, kwargs, site.options)
        return run_region_now(function, args, kwargs, site.options)

    def _reset_position(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        self.position = 0
        self._larger_elements = 0
        if self.mode == "planned" and not self._warned_larger:
            elements = _input_elements(args, kwargs)
            if elements > self._planned_elements > 0:
                self._larger_elements = elements  # said once a backward reaches the step's regions

    def _warn_in_backward(self, output: Any) -> None:
        """Warn about this step's larger inputs when backward reaches this region's output: a step
        that runs no backward (evaluation, even with grad enabled) holds nothing for it and is silent."""
        elements = self._larger_elements

        def warn(_: torch.Tensor) -> None:
            if self._warned_larger:
                return
            self._warned_larger = True
            if _rank() == 0:
                print(f"acshim: --budget: this step's inputs hold {elements} elements, the step planned on held "
                      f"{self._planned_elements}: activation memory grows with them, so the plan's peak may "
                      "exceed the budget (pad batches to one length, or plan on the largest batch first)",
                      file=sys.stderr, flush=True)

        for leaf in structures.flatten(output)[0]:
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(warn)
                return

    # ---------------------------------------------------------------------------------- planning
    def _capture(self, index: int, function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                 options: RegionOptions) -> Any:
        # the inputs the region runs on: a Hugging Face cache passed in is dropped (region_state), so a
        # block run alone while profiling never appends to it again (backward through a freed graph)
        args, kwargs = region_inputs(function, args, kwargs)
        site = self.sites[index] if index < len(self.sites) else None
        if site is None:
            owner = _owning_module(function)
            site = RegionSite(function, owner, _dialect_of_caller(), _describe(options))
            self.sites.append(site)
        if site.captured is None:
            site.captured = (*self._copies((args, kwargs)), _grad_flags((args, kwargs)))
        output = run_region_now(function, args, kwargs, RegionOptions())
        if site.recorded is None:
            site.recorded = self._copies(output)
        return self._mark_head(output)

    def _drop_copies(self) -> None:
        """Free the regions' captured inputs and recorded outputs once planning is over (they were
        held for the rest of the run: a full-recompute step's worth of memory)."""
        for site in self.sites:
            site.captured = site.recorded = None
        self._copies = Copies()

    def _mark_head(self, output: Any) -> Any:
        """While a step is tracked, mark when the gradient reaches this region's output: what runs
        before that in backward (the head, the loss) belongs to the part outside the regions."""
        if self._head_marked is not None:
            for leaf in structures.flatten(output)[0]:
                if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                    leaf.register_hook(lambda grad, mark=self._head_marked: mark())
                    break
        return output

    def _plan_now(self, function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                  options: RegionOptions) -> None:
        found = _model_on_stack()
        self.world = _world_size()
        sharded = _sharded_by(found[0] if found is not None else None) if self.world > 1 else None
        if sharded is not None:
            # FSDP / ZeRO gather parameters and reduce gradients with collectives inside each block's
            # forward and backward: running blocks alone while profiling would issue them out of step
            self.stop()
            raise PlanExit(2, f"acshim run --budget: planning across {self.world} ranks supports replicated models "
                              f"(DistributedDataParallel, or none); this one is sharded by {sharded}. Plan it on one "
                              "process (acshim plan --budget ... -- train.py on a single rank) and apply the plan "
                              "with acshim.Plan.load, or drop --budget")
        if found is None:
            self.stop()
            raise PlanExit(2, "acshim run --budget: the first checkpointed region ran outside any nn.Module's forward, "
                              "so there is no model to plan for; checkpoint blocks inside the model's forward (or "
                              "drop --budget)")
        root, root_args, root_kwargs = found
        self.root = root
        self._handle = root.register_forward_pre_hook(self._reset_position, with_kwargs=True)
        self._planned_elements = _input_elements(root_args, root_kwargs)
        snapshot = ModelSnapshot(root)
        try:
            with _counters_paused(), parameters_aliased(root):  # profiling never reaches the real parameters
                self.plan = self._solve(root, root_args, root_kwargs)
        except (BudgetTooSmall, ValueError) as error:
            self._drop_copies()
            snapshot.restore()
            self.stop()
            hint = (f"; pass --budget {budget_at_least(error.minimum)} or more"
                    if isinstance(error, BudgetTooSmall) else "")
            raise PlanExit(2, f"acshim run: --budget {self.budget}: {error}{hint}") from None
        except BaseException:
            self._drop_copies()
            snapshot.restore()
            self.stop()
            raise
        self._drop_copies()
        snapshot.restore()
        self.mode, self.position = "planned", 0  # route() takes position 0 for the interrupted call
        if self.plan.outside != "keep":
            # From the next step on (this one's forward began without it: its part before the
            # first region stays where it is)
            install_outside(root, self.plan.outside, self.prefetch, self._shared)
            self._outside = self.plan.outside
        lead = _rank() == 0  # every rank has the same plan: one rank says it
        if lead:
            print(self.summary(), file=sys.stderr, flush=True)
        if lead and self.png and not self.exit_after_plan:
            from .picture import write_png as write_picture

            print(f"acshim: {write_picture(self.plan, self.png)}", file=sys.stderr, flush=True)
        if self.exit_after_plan:
            self.stop()
            if lead:
                print(self.report(), flush=True)
            raise PlanExit(0)

    def _solve(self, root: nn.Module, root_args: tuple[Any, ...], root_kwargs: dict[str, Any]) -> Plan:
        excluded = excluded_keys(root, (root_args, root_kwargs))

        def step(tracker: LiveBytes | None = None) -> None:
            self.position = 0
            output = root(*root_args, **root_kwargs)
            loss = planning_loss(output, root_args, root_kwargs)
            del output
            if tracker is not None:
                tracker.mark("forward")
            loss.backward()
            del loss

        # 1. one step, every region fully recomputed, inputs captured, memory outside the regions
        tracker = LiveBytes(set(excluded))
        self._head_marked = lambda: tracker.mark("head") if "head" not in tracker.marks else None
        self.mode = "capture"
        root.zero_grad(set_to_none=True)
        with tracker:
            step(tracker)
            tracker.mark("end")
        self._head_marked = None
        if not self.sites:
            raise ValueError("the model's step ran no checkpointed region")
        series = tracker.series(grad_keys(root))
        tracker.release()
        held_full = series[tracker.marks["forward"] - 1]
        whole_peak = max(series[:max(tracker.marks.get("head", len(series)), tracker.marks["forward"])])
        tiers = (self.storage,) if self.storage else (("disk",) if _device(root).type == "cpu" else ("host",))
        choices = expand_choices(self.choices, tiers)
        if "recompute" not in choices:
            choices.append("recompute")
        # what lies outside the regions, alone (regions replayed): kept, and offloaded per tier
        outside: dict[str, dict[str, float]] = {}
        # a model that is itself a region has no outside part
        parts = outside_choices(root, choices) if checkpointed_forward_of(root) is None else ["keep"]
        for part in parts:
            held, peak, seconds = self._outside_alone(root, part, step, excluded)
            outside[part] = {"held": held, "transient": max(0, peak - held), "seconds": seconds}
        kept = outside.pop("keep")
        _err_high(kept, outside, whole_peak - held_full)

        # 2. each region alone, per choice
        names = _site_names(root, self.sites)
        self.names = names
        profiles: list[BlockProfile] = []
        measured: dict[Any, BlockProfile] = {}
        for name, site in zip(names, self.sites, strict=True):
            args, kwargs, flags = site.captured  # type: ignore[misc]
            key = (_code_of(site.function), _block_key(site.owner if site.owner is not None else nn.Module(), args, kwargs))
            if key in measured:
                first = measured[key]
                profiles.append(BlockProfile(name, dict(first.held), dict(first.transient), dict(first.seconds),
                                             first.name, dict(first.window)))
                continue
            held, transient, seconds, window = {}, {}, {}, {}
            excluded_here = excluded_keys(root, (args, kwargs))
            for choice in choices:
                self._shared = {}  # a fresh schedule per measurement
                proxy = functools.partial(self._alone, site, choice)
                offload = SharedOffload(choice.partition(":")[2], self.prefetch) if is_offload(choice) else None
                if offload is not None:
                    self._shared[offload.storage] = offload
                held[choice], transient[choice], seconds[choice], window[choice] = measure_choice(
                    proxy, args, kwargs, flags, excluded_here, functools.partial(grad_keys, root),
                    functools.partial(root.zero_grad, set_to_none=True), offload, self.repeats,
                    list((site.owner if site.owner is not None else root).parameters()))
            self._shared = {}
            measured[key] = BlockProfile(name, held, transient, seconds, window=window)
            profiles.append(measured[key])
        root.zero_grad(set_to_none=True)
        profile = Profile(
            blocks=profiles, choices=choices, other_held=int(kept["held"]), other_transient=int(kept["transient"]),
            other_seconds=kept["seconds"],
            signature=model_signature(root, [(n, s.owner if s.owner is not None else root)
                                             for n, s in zip(names, self.sites, strict=True)]),
            prefetch=self.prefetch, method=METHOD,
            recompute_step={"held": held_full, "peak": max(series),
                            "seconds": kept["seconds"] + sum(p.seconds["recompute"] for p in profiles)},
            outside=outside)

        if self.world > 1:  # every rank solves the same numbers, so every rank gets the same plan
            profile = agree_profile(profile, _device(root))
            profile.method += f"; agreed across {self.world} ranks (each number the largest any rank measured)"

        # 3. solve, verify on one step of the model under the candidate plan
        def measure(candidate: Plan) -> tuple[int, int]:
            self.mode, self._candidate = "measure", candidate.choices
            root.zero_grad(set_to_none=True)
            tracker = LiveBytes(set(excluded))
            install_outside(root, candidate.outside, self.prefetch, self._shared)
            self._outside = candidate.outside
            try:
                with tracker:
                    step(tracker)
                    tracker.mark("end")
            finally:
                install_outside(root, "keep")
                self._outside = "keep"
            found = tracker.series(grad_keys(root))
            tracker.release()
            self._shared = {}
            held, peak = found[tracker.marks["forward"] - 1], max(found)
            return agree_measurement(held, peak, _device(root)) if self.world > 1 else (held, peak)

        return solve_within(profile, self.budget, measure)

    def _outside_alone(self, root: nn.Module, outside: str, step: Callable[..., None], excluded: set[int]
                       ) -> tuple[int, int, float]:
        """``(held after forward, peak up to the head's backward, seconds)`` of the part of the model
        outside the regions run as ``outside``, every region replaying its recorded output."""
        self.mode = "replay"
        install_outside(root, outside, self.prefetch, {})
        tracker = LiveBytes(set(excluded) | recorded_keys([site.recorded for site in self.sites]))
        self._head_marked = lambda: tracker.mark("head") if "head" not in tracker.marks else None
        try:
            root.zero_grad(set_to_none=True)
            with tracker:  # warms a tier up too
                step(tracker)
                tracker.mark("end")
            self._head_marked = None
            root.zero_grad(set_to_none=True)
            seconds = _timed(step, self.repeats)
        finally:
            self._head_marked = None
            install_outside(root, "keep")
            root.zero_grad(set_to_none=True)
        series = tracker.series(grad_keys(root))
        tracker.release()
        held = series[tracker.marks["forward"] - 1]
        return held, max(series[:max(tracker.marks.get("head", len(series)), tracker.marks["forward"])]), seconds

    def _alone(self, site: RegionSite, choice: str, *args: Any, **kwargs: Any) -> Any:
        return self.run_choice(site, choice, site.function, args, kwargs)

    # ---------------------------------------------------------------------------------- reporting
    def summary(self) -> str:
        """The one log line: what the plan replaced."""
        plan = self.plan
        assert plan is not None
        asked: dict[str, int] = {}
        for site in self.sites:
            label = f"{site.dialect}: {site.asked}"
            asked[label] = asked.get(label, 0) + 1
        chosen: dict[str, int] = {}
        for choice in plan.choices:
            chosen[choice] = chosen.get(choice, 0) + 1
        ratio = f" ({plan.measured_peak / plan.reference_peak:.2f}x no checkpointing)" \
            if plan.reference_peak and plan.measured_peak is not None else ""
        return (f"acshim: --budget {format_bytes(plan.budget)}: replaced {len(self.sites)} region(s) "
                f"({', '.join(f'{n} {k}' for k, n in asked.items())}) by the plan "
                f"({', '.join(f'{n} {c}' for c, n in chosen.items())}"
                f"{'' if plan.outside == 'keep' else f'; outside the regions: {plan.outside}'}); "
                f"predicted peak {format_bytes(plan.peak)}, "
                f"measured {format_bytes(plan.measured_peak or 0)}{ratio}")

    def report(self) -> str:
        """``acshim plan``'s output: the plan table, with ``sweep`` the frontier and baselines."""
        plan = self.plan
        assert plan is not None
        lines = [str(plan)]
        if self.sweep:
            lines += ["", frontier_table(plan)]
            if self.png:
                from .picture import write_png as write_picture

                lines.append(write_picture(plan, self.png))
        return "\n".join(lines)


def frontier_table(plan: Plan) -> str:
    """The predicted memory vs step-time frontier, and uniform recipes beside it (predicted from the
    same block profile: the model never runs without checkpointing)."""
    ref_peak, ref_seconds = plan.reference_peak or 1, plan.reference_seconds or 1.0
    rows = ["frontier (predicted from the block profile)",
            f"{'budget':>12} {'peak':>12} {'peak x':>7} {'step ms':>9} {'step x':>7}  choices"]
    for point in plan.frontier():
        rows.append(f"{format_bytes(point.budget):>12} {format_bytes(point.peak):>12} {point.peak / ref_peak:>7.2f} "
                    f"{point.seconds * 1e3:>9.1f} {point.seconds / ref_seconds:>7.2f}  {_counts(point.choices)}"
                    f"{'' if point.outside == 'keep' else f'; outside {point.outside}'}")
    rows.append("baselines (every region the same, predicted)")
    for label, choice in _baselines(plan.profile):
        peak, seconds = _baseline_point(plan, choice)
        rows.append(f"{label:>12} {format_bytes(peak):>12} {peak / ref_peak:>7.2f} {seconds * 1e3:>9.1f} "
                    f"{seconds / ref_seconds:>7.2f}  {choice}")
    return "\n".join(rows)


def _baselines(profile: Profile) -> list[tuple[str, str]]:
    wanted = [("none", "keep"), ("recompute", "recompute"), ("selective", "selective")]
    wanted += [("offload", c) for c in profile.choices if c.startswith("offload:")][:1]
    return [(label, choice) for label, choice in wanted if choice in profile.choices]


def _baseline_point(plan: Plan, choice: str) -> tuple[int, float]:
    """Predicted (peak, seconds) of every region run as ``choice``; offload offloads the part outside
    the regions too when it was profiled (as one ``acshim.offload()`` around the step would)."""
    assignment = [choice] * len(plan.blocks)
    outside = choice if choice in plan.profile.outside else "keep"
    return plan.profile.peak_of(assignment, outside), plan.profile.seconds_of(assignment, outside)


def _counts(choices: list[str]) -> str:
    counts: dict[str, int] = {}
    for choice in choices:
        counts[choice] = counts.get(choice, 0) + 1
    return ", ".join(f"{n} {c}" for c, n in counts.items())


def _check_budget(budget: Any) -> None:
    try:
        parse_budget(budget, 1)
    except (TypeError, ValueError) as error:
        raise ValueError(f"--budget {budget}: {error}") from None


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


_CALL_CODES = {nn.Module._call_impl.__code__, getattr(nn.Module, "_wrapped_call_impl", nn.Module._call_impl).__code__}


def _model_on_stack() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]] | None:
    """The outermost ``nn.Module`` call on this thread's stack that is not a data-parallel wrapper,
    with the arguments it was called with."""
    frame: types.FrameType | None = sys._getframe(1)
    found = None
    while frame is not None:
        if frame.f_code in _CALL_CODES:
            module = frame.f_locals.get("self")
            if isinstance(module, nn.Module) and type(module).__name__ not in _WRAPPERS:
                found = (module, tuple(frame.f_locals.get("args", ())), dict(frame.f_locals.get("kwargs", {})))
        frame = frame.f_back
    return found


_ENGINE_MODULES = ("acshim.region", "acshim.report", "acshim.planner", "acshim.compiled", "acshim.dropin",
                   "acshim.wrap", "acshim.structures", "torch.", "functools", "contextlib")


def _dialect_of_caller() -> str:
    """Which API made the region call: the nearest caller outside the engine (and torch) is a facade
    (its dialect), ``acshim.hf`` (``hf``) or anything else (``acshim``)."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not (name.startswith(_ENGINE_MODULES) or name == "torch"):
            if name == "acshim.patching.torch_route":
                return "torch.utils.checkpoint"
            if name.startswith("acshim.facades."):
                parts = name.split(".")
                return "torch.sagemaker" if parts[2:4] == ["torch", "sagemaker"] else (
                    "torch checkpoint_wrapper" if parts[2] == "torch" else parts[2])
            return "hf" if name.startswith("acshim.hf") else "acshim"
        frame = frame.f_back
    return "acshim"


def _describe(options: RegionOptions) -> str:
    if options.context_fn is not None:
        return "selective"
    kind = "reentrant recompute" if options.reentrant else "recompute"
    return kind + (" + offload" if options.saved_tensors_scope is not None else "")


def _site_names(root: nn.Module, sites: list[RegionSite]) -> list[str]:
    names = {id(module): name for name, module in root.named_modules()}
    out = []
    for index, site in enumerate(sites):
        name = names.get(id(site.owner)) if site.owner is not None else None
        out.append(name if name else f"region{index}:{getattr(site.function, '__qualname__', 'fn')}"[:40])
    return out


def _code_of(function: Callable[..., Any]) -> Any:
    while isinstance(function, functools.partial):
        function = function.func
    return getattr(function, "__code__", None) or getattr(getattr(function, "__func__", None), "__code__", None) \
        or type(function)


def _device(module: nn.Module) -> torch.device:
    return next(module.parameters(), torch.empty(0)).device


def _sharded_by(root: nn.Module | None) -> str | None:
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


def _input_elements(args: Any, kwargs: Any) -> int:
    """Elements of the tensors a model call got: what activation memory scales with."""
    leaves, _ = structures.flatten((args, kwargs))
    return sum(leaf.numel() for leaf in leaves if isinstance(leaf, torch.Tensor))


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world_size() -> int:
    """Ranks of an initialized default process group, else 1."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
