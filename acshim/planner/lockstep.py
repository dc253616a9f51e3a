"""Plan a sharded model (FSDP2, FSDP, a DeepSpeed engine: ZeRO-3) across its real training steps.

FSDP and ZeRO-3 gather each block's parameters and reduce its gradients with collectives in the
block's own hooks, so a block run alone while profiling (``profiler.RegionProfiler``) would issue
them on one rank out of step with the others. A sharded model is therefore only ever run by the
script's own steps, in lock-step on every rank:

1. **Explore**: the step planning starts in, and the next (``EXPLORE_STEPS``), run every region as
   ``base``: recomputed with its input on the storage tier (``recompute+offload:TIER``), the least
   memory any plan of these choices has (recomputed where no tier moves anything). Each region's
   forward counts what keeping it would hold, and its forward's peak had it been kept
   (``SavedCounter``: chained to torch checkpoint's own saved-tensor hooks, so nothing more is
   held), and is timed. The process's memory above the step's start is measured per phase
   (``StepPeak``: each region's forward, each region's recompute and backward, the rest), after
   every operator (``process.Guard``, recording only: stopping one rank mid-step would leave the
   others waiting in a collective) and every millisecond by a thread. Then, each only where its
   peak predicted from the steps so far fits the budget (``_next_step``), one step runs every
   region recomputed (counted the same way; where it does not fit, recompute's numbers come from
   the base's: a region holds its output, and its backward fetches nothing back), one every region
   as each other storage choice (``offload:TIER``, predicted from keep's numbers), and, after a
   recomputed step only, one runs one region of each kind ``selective`` and one ``selective-alt``
   (``SAMPLED``); with them every choice's held bytes per region are explicit (``explored``).
   Where the model has an LM head ``acshim.head`` can run, every one of these steps runs the head
   and loss in chunks (``HEAD_MODE``: the least the part outside the regions can hold), and a last
   step, where its predicted peak fits, runs them kept (``KEEP_STEP``); where it does not, keeping
   them is estimated from the logits (``KEPT_LOGITS``) and not offered.
2. **Solve**: at the next step's start every rank agrees the numbers (each the largest any rank
   measured, ``agree.agree_profile``); rank 0 solves them with the exact DP (``_profile`` maps the
   phases onto the solver's peak formula) and broadcasts the plan, so no two ranks can run
   different plans.
3. **Verify**: that step runs the plan and is measured the same way; a peak above the accepted share
   of the budget is solved again with the miss as room left for (all recompute if nothing else
   fits), for the next step, at most ``retries`` times, and said on stderr.

Every choice gives the same gradients bitwise, so exploring on real steps changes nothing but their
memory and time. Limits (docs/cli.md): choices are keep, recompute, selective-op and the storage
tier's per region, keep and the chunked head for the part outside them (not the head's loss mode,
nor that part offloaded); no checkpointing's peak (a fraction's reference) is
predicted from the explored steps, with the head kept as ``KEEP_STEP`` measured it or, where that
step was predicted over the budget, from below (``KEPT_LOGITS``); a budget below the least plan is
refused after them, naming a budget that plans.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from .. import region as engine
from .. import structures
from ..head import find_head
from ..measure import storage_key
from ..region import run_region_now
from ..wrap import checkpointed_forward_of
from .agree import agree_bytes, agree_every_rank, agree_profile
from .budget import budget_at_least, format_bytes, parse_budget
from .choices import SharedOffload, choice_options, expand_choices, install_outside, outside_choices
from .explored import HELD_UNIT, ChoiceSteps, median_per_key, rounded
from .plan import HEADROOM, Plan, reference, solve_within
from .process import Guard, ProcessMemory, trim
from .profile import INFEASIBLE, BlockProfile, Profile, block_key, model_signature
from .routing import PlanningContext
from .sampled import SelectiveSaved
from .sites import device_of, outermost_module_on_stack, rank, site_names
from .solver import BudgetTooSmall, minimum_peak, rounded_peak

CHOICES = ["keep", "recompute"]

METHOD = ("measured on the script's own steps, in lock-step on every rank (a sharded model's blocks gather "
          "and reduce with collectives): two steps ran every region recomputed, counting what each would "
          "hold kept, with the process's peak per phase; the plan's first step verified it")

EXPLORE_STEPS = 2
"""Steps run every region recomputed before solving, the largest peak and counts taken: a sharded
engine's first step is not its steady state (ZeRO-3 records the order its modules run in on the
first step and prefetches their parameters from the second on: 7 MB more on the test model)."""

BACKWARD_SHARE = 2.0
"""A region's backward, as a multiple of its forward, in the times the solver compares (only the
forward a kept region does not repeat differs between plans, so any constant serves)."""


SUGGESTION_MARGIN = 0.10
"""Room above the least peak in the budget a sharded refusal names (``BudgetTooSmall.MARGIN`` is
0.05 for a model measured region by region): the script's own steps on every rank vary more from
one process to the next (FSDP2 on 2 gloo ranks with the CI's other worker running: the least peak
measured again 6.4% above the first run's, so a budget 5% above it was refused once more)."""

SAMPLED = ("selective", "selective-alt")
"""Choices explored on a sample of the regions, all on one step (``SAMPLED_STEP``): per kind of
region (``profile.block_key``), its last region runs ``selective``, the one before it
``selective-alt``, the rest recompute. A selective region holds what its policy saves (matmul and
attention outputs), so running every region selective would hold most of no checkpointing's
activations on that step; the last regions' are freed first in backward. The step runs as many of
these choices as its predicted peak leaves room for within the budget (``_choose_samples``), and
none (it is skipped) where not even one fits or the regions gather parameters themselves. The other regions of a kind take the sampled
region's difference from recompute (``explored``). A choice is offered where every kind of region,
on every rank, was sampled with it (``selective-alt`` needs two of a kind)."""

SAMPLED_STEP = "sampled"
"""The explored step that runs the ``SAMPLED`` choices on one region of each kind."""

HEAD_MODE = "head"
"""The part outside the regions a sharded model is offered besides keeping it: ``acshim.head``'s
``head`` mode (the LM head and its cross-entropy in chunks of the sequence, the head recomputed in
backward: the logits are not kept), where the model has a head it can run."""

KEEP_STEP = "outside:keep"
"""The explored step that runs every region as the counted steps did (``work``) and the part outside
them kept, where the model has a head (every other explored step runs it as ``HEAD_MODE``)."""

KEPT_LOGITS = (1, 4)
"""Where ``KEEP_STEP`` has not run, what keeping the head and its loss holds beyond ``HEAD_MODE``,
in logits-sized float32 tensors (the head's output as the loss upcasts it), at least and at most:
at least the log-softmax cross-entropy saves for backward (both modes hold the logits themselves,
and the chunked head's backward makes their whole gradient too); at most also the log-softmax's
gradient, the logits' and a shifted copy some losses make. Measured on FSDP2 GPT-2 (vocabulary 8192,
32 MiB of logits): keeping held 44 MiB (1.4 logits) more than the chunked head at its peak. The
least estimates no checkpointing's peak (a fraction's reference, so never above what a user would
measure); the most decides whether ``KEEP_STEP`` is predicted to fit."""

PHASE_UNIT = 1 << 20
"""Phase peaks are rounded up to this: a few pages of noise between runs must not reorder plans
that differ only in which identical block is kept."""


def _rounded(size: int) -> int:
    return -(-size // PHASE_UNIT) * PHASE_UNIT


class SavedCounter:
    """Counts the storages a region's forward saves for backward that keeping it would hold:
    neither parameters (FSDP and ZeRO gather and free those themselves) nor its inputs (held as the
    recomputed region's inputs too). Entered as the forward half of torch checkpoint's
    ``context_fn``, inside checkpoint's own saved-tensor hooks: each tensor is counted, then handed
    to checkpoint's pack hook, so the region holds exactly what recompute holds. Written by hand:
    torch has no hook that sees what a checkpointed forward would have saved."""

    def __init__(self, inputs: set[int], memory: ProcessMemory | None = None, baseline: int = 0) -> None:
        self.inputs = inputs
        self.memory, self.baseline = memory, baseline
        self.kept_peak = 0
        """With ``memory``: the process's memory above ``baseline`` at each saved tensor, plus the
        counted storages recompute had freed by then (keeping the region would still hold them):
        the forward's peak if the region were kept, sampled as it saves."""
        self._freed = 0
        self._live: list[tuple[weakref.ref[torch.Tensor], int]] = []
        self.total = 0
        self._seen: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        """Storage id -> (a tensor on it, weakly; its bytes). Nothing is held, so a storage can be
        freed and its id reused by a later one, which counts anew once the old tensor is gone."""
        self._hooks: saved_tensors_hooks | None = None

    def __enter__(self) -> SavedCounter:
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if outer is None:  # not under checkpoint's hooks: nothing is saved for a recompute to rebuild
            return self
        pack, unpack = outer

        def counting_pack(tensor: torch.Tensor) -> Any:
            self._count(tensor)
            if self.memory is not None:
                self._sample_kept()
            return pack(tensor)

        self._hooks = saved_tensors_hooks(counting_pack, unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(*exc_info)
            self._hooks = None

    def _count(self, tensor: torch.Tensor) -> None:
        if isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter):
            return
        found = storage_key(tensor)
        if found is None or found[0] in self.inputs:
            return
        seen = self._seen.get(found[0])
        if seen is None or seen[0]() is None:
            size = found[1].nbytes()
            self._seen[found[0]] = (weakref.ref(tensor), size)
            self._live.append((weakref.ref(tensor), size))
            self.total += size

    def _sample_kept(self) -> None:
        live = []
        for ref, size in self._live:
            if ref() is None:
                self._freed += size
            else:
                live.append((ref, size))
        self._live = live
        self.kept_peak = max(self.kept_peak, self.memory.current() - self.baseline + self._freed)  # type: ignore[union-attr]

    def held(self, output: Any) -> int:
        """Bytes counted, less the region's output where it was saved too (held by whatever uses
        it, kept or not)."""
        outputs = {key[0] for leaf in structures.flatten(output)[0] if (key := storage_key(leaf)) is not None}
        shared = sum(size for key, (ref, size) in self._seen.items() if key in outputs and ref() is not None)
        self._seen.clear()
        return self.total - shared


class StepPeak:
    """The process's peak above ``baseline`` during one training step, overall and per phase: a
    recording ``Guard`` over the rest of the model's forward (from ``start`` to the model's forward
    hook) and over every ``torch.autograd.backward`` until ``finish`` (``Tensor.backward`` and the
    engines' backward call it); the optimizer's step is left out (its state is the run's, like the
    parameters). ``phases``: ``"forward"``, the forward outside the regions; ``"forward:<i>"``,
    region i's forward; ``"head"``, from the forward's end to the first region's recompute (the loss
    and the head's backward); and region i's index, from its recompute's start to the next one's or
    backward's end (region observer events, ``_RegionMarks``)."""

    SAMPLE_SECONDS = 0.001
    """A thread samples the process's memory this often as well: what a collective's library
    allocates and frees inside one operator is never there when the operator returns."""

    def __init__(self, memory: ProcessMemory, baseline: int) -> None:
        self.guard = Guard(memory, baseline, None)
        self.phases: dict[str | int, int] = {}
        self.seconds: dict[str | int, float] = {}
        """Per phase, the time spent in it (summed where a phase is entered again)."""
        self.start_held: int | None = None
        """The process's memory above ``baseline`` when the first region's forward started."""
        self.held_after: dict[int, int] = {}
        """Per region, the process's memory above ``baseline`` when its forward ended."""
        self._phase: str | int | None = None
        self._since = 0.0
        self._sampled = 0
        self._sampled_phase = 0
        self._handle: Any = None
        self._original: Callable[..., Any] | None = None
        self._in_forward = False
        self._done = threading.Event()
        self._sampler = threading.Thread(target=self._sample, name="acshim-step-peak", daemon=True)

    def _sample(self) -> None:
        memory, baseline = self.guard.memory, self.guard.baseline
        while not self._done.wait(self.SAMPLE_SECONDS):
            if self._phase is None:  # between the backward and the next step: the optimizer's
                continue
            used = memory.current() - baseline
            self._sampled = max(self._sampled, used)
            self._sampled_phase = max(self._sampled_phase, used)

    def enter_phase(self, phase: str | int | None) -> None:
        """Close the current phase (its peak recorded) and open ``phase``."""
        used = self.guard.sample() if self.guard.memory.available else 0
        now = time.perf_counter()
        if self._phase is not None:
            peak = max(self.guard.window_peak, self._sampled_phase, used)
            self.phases[self._phase] = max(self.phases.get(self._phase, 0), peak)
            self.seconds[self._phase] = self.seconds.get(self._phase, 0.0) + now - self._since
        self._phase, self._since = phase, now
        self.guard.window_peak = self._sampled_phase = used

    def region_forward(self, index: int) -> None:
        """Region ``index``'s forward starts (the first one's start is noted)."""
        self.enter_phase(f"forward:{index}")
        if self.start_held is None:
            self.start_held = self.guard.last

    def region_forward_done(self, index: int) -> None:
        """Region ``index``'s forward ended: what the process holds now is noted."""
        self.enter_phase("forward")
        self.held_after[index] = self.guard.last

    def start(self, root: nn.Module) -> None:
        self._sampler.start()
        self.guard.__enter__()
        self._in_forward = True
        self.enter_phase("stem")
        self._handle = root.register_forward_hook(self._forward_done, always_call=True)

    def _forward_done(self, module: nn.Module, args: Any, output: Any) -> None:
        self._leave_forward()
        if self._original is None:
            self._original = original = torch.autograd.backward

            def measured_backward(*args: Any, **kwargs: Any) -> Any:
                if self._phase is None:  # a second backward in the step (accumulation)
                    self.enter_phase("head")
                with self.guard:
                    try:
                        return original(*args, **kwargs)
                    finally:
                        self.enter_phase(None)

            torch.autograd.backward = measured_backward

    def _leave_forward(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self._in_forward:
            self._in_forward = False
            self.enter_phase("head")
            self.guard.__exit__(None, None, None)

    def finish(self) -> int:
        """Stop measuring; the peak in bytes."""
        self._leave_forward()
        self.enter_phase(None)
        if self._original is not None:
            torch.autograd.backward = self._original
            self._original = None
        if self._sampler.is_alive():
            self._done.set()
            self._sampler.join()
        return max(0, self.guard.peak, self._sampled, *self.phases.values())


def storage_choices(session: PlanningContext, device: torch.device) -> list[str]:
    """The storage tier's choices a sharded model is offered, as the single-process planner names
    them: the session's tier, else disk on CPU and host memory on an accelerator; none where that
    tier would move nothing (host memory on CPU)."""
    tiers = (session.storage,) if session.storage else (("disk",) if device.type == "cpu" else ("host",))
    return [choice for choice in expand_choices(session.choices, tiers)
            if choice.partition(":")[0] in ("offload", "recompute+offload")
            and not (choice.endswith(":host") and device.type == "cpu")]


def sampled_choices(session: PlanningContext) -> list[str]:
    """The ``SAMPLED`` choices ``session`` offers."""
    offered = expand_choices(session.choices, ("disk",))
    return [choice for choice in SAMPLED if choice in offered]


def head_modes(root: nn.Module | None) -> list[str]:
    """``[HEAD_MODE]`` where ``root`` has an LM head ``acshim.head`` can run (and its own forward is
    not checkpointed whole), else none."""
    if root is None or checkpointed_forward_of(root) is not None:
        return []
    return [choice for choice in outside_choices(root, []) if choice == HEAD_MODE]


def explore_steps(session: PlanningContext) -> int:
    """The steps ``session``'s sharded model is explored on before its plan (also after it stopped;
    at most: the sampled step is skipped where no sample fits)."""
    device = device_of(session.root) if session.root is not None else torch.device("cpu")
    return (EXPLORE_STEPS + len(storage_choices(session, device)) + (1 if sampled_choices(session) else 0)
            + len(head_modes(session.root)))


def _activation_bytes(value: Any) -> int:
    """Bytes of the distinct storages of ``value``'s tensors that need gradients, parameters aside."""
    storages: dict[int, int] = {}
    for leaf in structures.flatten(value)[0]:
        if (isinstance(leaf, torch.Tensor) and leaf.requires_grad and not isinstance(leaf, nn.Parameter)
                and (key := storage_key(leaf)) is not None):
            storages[key[0]] = key[1].nbytes()
    return sum(storages.values())


def _mark_backward(output: Any, index: int, peak: StepPeak) -> None:
    """Open the step's phase ``index`` when the gradient of ``output`` (a region run without
    recompute) arrives: its backward starts, as a recompute's start marks it (``_RegionMarks``)."""

    def hook(grad: torch.Tensor) -> None:
        if peak._phase != index:
            peak.enter_phase(index)

    for leaf in structures.flatten(output)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            leaf.register_hook(hook)


class _RegionMarks:
    """A region observer: its forward opens the step's phase ``"forward:<index>"`` (and its end goes
    back to ``"forward"``), its recompute the phase ``index``."""

    def __init__(self, index: int, peak: StepPeak) -> None:
        self.index, self.peak = index, peak

    def forward_start(self, region: Any) -> None:
        self.peak.region_forward(self.index)

    def forward_end(self, region: Any) -> None:
        self.peak.region_forward_done(self.index)

    def recompute_start(self, region: Any) -> None:
        self.peak.enter_phase(self.index)


class LockstepPlanner:
    """Plans ``session``'s sharded model on its real steps (see the module docstring)."""

    def __init__(self, session: PlanningContext, root: nn.Module, memory: ProcessMemory, baseline: int,
                 explore: bool = True) -> None:
        self.session, self.root, self.memory = session, root, memory
        self.device = device_of(root)
        self.saved: dict[int, int] = {}
        self.seconds: dict[int, float] = {}
        self.keys: dict[int, Any] = {}
        """Per region, what identical regions share (``profile.block_key``: class, parameter and
        input shapes): one time for all of them, so the solver's ties between them are exact."""
        self.kept_forward: dict[str, dict[int, int]] = {}
        """Per counted choice (``recompute``, the ``base``), per region, its forward's peak had it
        been kept (``SavedCounter.kept_peak``) above that choice's step start."""
        self.input_bytes: dict[int, int] = {}
        """Per region, the bytes of its inputs that need gradients (the activations it is handed,
        which ``recompute+offload`` moves to the tier and fetches back in backward)."""
        self.output_bytes: dict[int, int] = {}
        """Per region, the bytes of its outputs that need gradients: what a recomputed region leaves
        behind (the next one's input, held as it). Both derive recompute from ``recompute+offload``
        where its step did not fit the budget (``_blocks_explored``)."""
        self.phase_peaks: dict[str | int, int] = {}
        """The explored steps' peaks per phase (``StepPeak.phases``), the largest of the steps."""
        self.measuring: StepPeak | None = StepPeak(memory, baseline) if explore else None
        self.storage_choices = storage_choices(session, self.device)
        """The storage tier's choices offered (``offload:TIER``, ``recompute+offload:TIER``): each is
        explored on one step of its own after the recomputed ones (``explored``)."""
        self.sampled_choices = sampled_choices(session)
        """The choices explored on a sample of the regions, on one step after the storage choices'."""
        self.head_modes = head_modes(root)
        """The part outside the regions' choice besides keep (``HEAD_MODE``), which every explored
        step but ``KEEP_STEP`` runs."""
        self._head_installed = False
        self._outside_mode = HEAD_MODE if self.head_modes else "keep"
        """How the explored steps run the part outside the regions (``KEEP_STEP`` keeps it)."""
        self.logits_bytes = 0
        """The largest logits the head made on an explored step, as float32 bytes (``KEPT_LOGITS``)."""
        head = find_head(root) if self.head_modes else None
        self._head_hook = head.register_forward_hook(self._count_logits) if head is not None else None
        self.base = next((c for c in self.storage_choices if c.startswith("recompute+offload")), "recompute")
        """What the first (``EXPLORE_STEPS``) steps run every region as: the least memory a plan can
        have (the activations the regions are handed on the storage tier), else recompute."""
        self._order: list[str] = []
        self._pending: list[str] = []
        self.skipped: list[str] = []
        """Steps not explored because their predicted peak was over the budget (their choice is
        then derived, ``recompute``, or not offered)."""
        self._reset_steps()
        self.sampled_at: dict[str, dict[Any, int]] = {}
        """Per sampled choice, per kind of region (``self.keys``' values), the region run as it."""
        self.sampled_saved: dict[str, dict[Any, int]] = {}
        """Per sampled choice, per kind of region, the bytes its sampled region cached for backward
        (``sampled.SelectiveSaved``; absent where they could not be counted)."""
        self._samples: dict[int, str] = {}
        """Region index -> the sampled choice it runs on the sampled step (``_choose_samples``)."""
        self.runs: dict[str, ChoiceSteps] = {}
        """Per explored choice (``SAMPLED_STEP`` for the sampled step), what its steps measured."""
        self.run_peaks: dict[str, int] = {}
        """Per explored choice, its steps' largest peak (agreed across ranks)."""
        self._scope: SharedOffload | None = None
        """The ``offload`` step's schedule, shared by its regions (``choices.SharedOffload``)."""
        self.exploring = explore
        self.explored = 0
        self.profile: Profile | None = None
        self.peaks: list[int] = []
        """The measured steps' peaks (agreed across ranks): the explored one first, then verifications."""
        self.verifications = 0
        self.step_baseline: int | None = None
        """The process's memory when the latest step's outermost module call started (before a
        wrapper's own forward work: a DeepSpeed engine gathers and prefetches parameters there)."""
        outer = outermost_module_on_stack() or root
        self._outer = outer.register_forward_pre_hook(self._step_starts, prepend=True)
        if self.measuring is not None:
            self._run_outside(self._outside_mode)  # before the step's forward reaches the head
            self.measuring.start(root)

    def _count_logits(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.exploring and isinstance(output, torch.Tensor) and torch.is_grad_enabled():
            self.logits_bytes = max(self.logits_bytes, output.numel() * max(4, output.element_size()))

    def _step_starts(self, module: nn.Module, args: Any) -> None:
        # while steps are measured (a step with larger inputs, later, reads it at the model's start)
        if self.measuring is not None and torch.is_grad_enabled() and module.training:
            trim()
            self.step_baseline = self.memory.current()

    # ---------------------------------------------------------------------------------- steps
    def explore(self, index: int, function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
                ) -> Any:
        """Run region ``index`` recomputed, counting what it would hold kept and timing its forward (or,
        on a storage choice's step, as that choice)."""
        choice = self.step_choice
        if choice == SAMPLED_STEP:
            return self._explore_sampled(index, function, args, kwargs)
        if choice == KEEP_STEP:
            options = choice_options(self.work).replace(observer=_RegionMarks(index, self.measuring))
            return run_region_now(function, args, kwargs, options)
        if choice not in ("recompute", self.base):
            return self._explore_stored(choice, index, function, args, kwargs)
        inputs = {key[0] for leaf in structures.flatten((args, kwargs))[0] if (key := storage_key(leaf)) is not None}
        self.input_bytes[index] = max(self.input_bytes.get(index, 0), _activation_bytes((args, kwargs)))
        measuring = self.measuring
        counter = (SavedCounter(inputs, measuring.guard.memory, measuring.guard.baseline) if measuring is not None
                   else SavedCounter(inputs))
        options = choice_options(choice).replace(context_fn=lambda: (counter, contextlib.nullcontext()),
                                                 observer=_RegionMarks(index, self.measuring))
        owner = self.session.sites[index].owner if index < len(self.session.sites) else None
        self.keys.setdefault(index, block_key(owner, args, kwargs) if owner is not None else index)
        began = time.perf_counter()
        output = run_region_now(function, args, kwargs, options)
        elapsed = time.perf_counter() - began  # the least over the explored steps (the first one warms up)
        self.seconds[index] = min(self.seconds.get(index, elapsed), elapsed)
        self.saved[index] = max(self.saved.get(index, 0), counter.held(output))
        self.output_bytes[index] = max(self.output_bytes.get(index, 0), _activation_bytes(output))
        kept = self.kept_forward.setdefault(choice, {})
        kept[index] = max(kept.get(index, 0), counter.kept_peak)
        return output

    def _reset_steps(self) -> None:
        """The explored steps' order from the start: ``EXPLORE_STEPS`` as the ``base``, then, each
        where its predicted peak fits the budget (``_next_step``), recompute, the other storage
        choices, the sampled step and the one keeping the head (``KEEP_STEP``)."""
        self._order = [self.base] * EXPLORE_STEPS
        self._pending = ((["recompute"] if self.base != "recompute" else [])
                         + [choice for choice in self.storage_choices if choice != self.base]
                         + ([SAMPLED_STEP] if self.sampled_choices else []) + ([KEEP_STEP] if self.head_modes else []))
        self.skipped = []

    @property
    def explore_steps(self) -> int:
        """Steps explored so far, or decided to be (all of them once the plan is made)."""
        return len(self._order)

    @property
    def step_choice(self) -> str:
        """What the step being explored runs (a choice for every region, ``SAMPLED_STEP`` or
        ``KEEP_STEP``)."""
        return self._order[self.explored] if self.explored < len(self._order) else "recompute"

    @property
    def work(self) -> str:
        """The counted steps' choice the others are compared with: recompute where its step ran,
        else the ``base``."""
        return "recompute" if "recompute" in self.runs else self.base

    def _next_step(self) -> None:
        """After the steps decided so far (every rank at once): the next pending step whose
        predicted peak fits the budget is explored next; the others are skipped (``skipped``).
        Recompute and the storage choices are predicted from the steps so far (``_fits``); the
        sampled step runs after a recomputed one only, as many samples as fit (``_choose_samples``);
        the step keeping the head runs its regions as ``work`` and is predicted with keeping the head
        estimated at its most (``KEPT_LOGITS``), never where the head's logits were not seen."""
        while self._pending:
            step = self._pending.pop(0)
            if step == SAMPLED_STEP:
                if "recompute" in self.runs:
                    self._choose_samples()
                else:
                    self.sampled_choices = []
                fits = bool(self.sampled_choices)
            elif step == KEEP_STEP:  # unbounded where the logits went unseen (a fused head, no nn.Linear)
                fits = self.logits_bytes > 0 and self._fits(self.work, outside="keep")
            else:
                fits = self._fits(step)
            if fits:
                self._order.append(step)
                return
            self.skipped.append(step)

    def _explore_sampled(self, index: int, function: Callable[..., Any], args: tuple[Any, ...],
                         kwargs: dict[str, Any]) -> Any:
        """Run region ``index`` as the ``SAMPLED`` choice ``_choose_samples`` gave it (else
        recomputed), measured."""
        measuring = self.measuring
        assert measuring is not None
        owner = self.session.sites[index].owner if index < len(self.session.sites) else None
        key = self.keys.setdefault(index, block_key(owner, args, kwargs) if owner is not None else index)
        choice = self._samples.get(index, "recompute")
        options = choice_options(choice).replace(observer=_RegionMarks(index, measuring))
        if choice == "recompute":
            return run_region_now(function, args, kwargs, options)
        inputs = {found[0] for leaf in structures.flatten((args, kwargs))[0] if (found := storage_key(leaf)) is not None}
        counter = SelectiveSaved(options.context_fn, inputs)
        output = run_region_now(function, args, kwargs, options.replace(context_fn=counter))
        self.sampled_at.setdefault(choice, {})[key] = index
        if counter.counted:
            self.sampled_saved.setdefault(choice, {})[key] = counter.total
        return output

    def _choose_samples(self) -> None:
        """Before the sampled step (every rank at once): the last region of each kind runs the
        first ``SAMPLED`` choice, the one before it the second, as many choices as fit the budget
        by the step's predicted peak: each recomputed phase's peak plus what the sampled regions
        alive then would save kept (``SavedCounter``: an estimate, as a selective region caches
        matmul outputs keep may not save; the step itself is measured). Where not
        even one fits, no choice is sampled and the step is skipped. Regions whose own call gathers
        parameters (ZeRO-3, ``fully_shard`` inside the checkpointed module) are sampled too: their
        recompute gathers again what the forward found prefetched, which acshim's selective policies
        recompute (``selective._UnsavedOpsRecomputed``) where torch's own SAC raises "encountered
        during backward but not found in storage"."""
        count = 1 + max(self.keys, default=-1)
        kinds: dict[Any, list[int]] = {}
        for index in range(count):
            kinds.setdefault(self.keys.get(index, index), []).append(index)
        budget = self._budget(self._provisional())
        chosen: dict[int, str] = {}
        for many in range(len(self.sampled_choices), 0, -1):
            samples = {index: choice for indexes in kinds.values()
                       for choice, index in zip(self.sampled_choices[:many], reversed(indexes), strict=False)}
            if agree_bytes(self._sampled_peak(samples), self.device) <= budget * (1 - HEADROOM):
                chosen = samples
                break
        self._samples = chosen
        self.sampled_choices = self.sampled_choices[:len(set(chosen.values()))]

    def _provisional(self, estimated: str | None = None, most: bool = False) -> Profile:
        """The profile the steps explored so far give (this rank's numbers; no times), with
        ``estimated`` (an ``offload`` choice not explored yet) estimated from keep's: nothing held
        but its window, the size of the largest region's saved tensors, and keep's transient plus
        that window and the copies the tier lets be in flight (``SharedOffload.IN_FLIGHT``); the
        part outside the regions as ``_with_outside`` gives it (``most``: kept, at its most)."""
        count = 1 + max(self.keys, default=-1)
        names = [str(index) for index in range(count)]
        explored = [choice for choice in self.storage_choices if choice in self.runs]
        peak = self.run_peaks.get(self.work, 0)
        blocks, other_held, outside = (self._blocks_explored(names, [0.0] * count, peak, explored, []) if explored
                                       else self._recomputed_blocks(names, [0.0] * count, peak))
        choices = [*CHOICES, *explored]
        if estimated is not None:
            window = rounded(max((block.saved for block in blocks), default=0), HELD_UNIT)
            for block in blocks:
                block.held[estimated], block.window[estimated] = HELD_UNIT, window
                block.transient[estimated] = block.transient["keep"] + window + SharedOffload.IN_FLIGHT
            choices.append(estimated)
        profile = Profile(blocks=blocks, choices=choices, other_held=other_held, other_transient=outside,
                          other_seconds=0.0, signature="", prefetch=self.session.prefetch)
        return self._with_outside(profile, peak, explicit=bool(explored), most=most)

    def _budget(self, profile: Profile) -> int:
        """The budget in bytes (a fraction taken of no checkpointing's peak as ``profile``, agreed
        across ranks, predicts it)."""
        return parse_budget(self.session.planned_budget, agree_bytes(reference(profile)[0], self.device))

    def _fits(self, choice: str, outside: str | None = None) -> bool:
        """Whether a step running every region as ``choice`` and the part outside them as ``outside``
        (default: as the explored steps run it) is predicted within the budget's accepted share on
        every rank (``_provisional``, keeping the head at its most where no step kept it; agreed, so
        every rank decides alike)."""
        mode = outside or self._outside_mode
        estimated = None if choice in self.runs or choice == "recompute" else choice
        profile = self._provisional(estimated)
        predicting = (self._provisional(estimated, most=True)
                      if mode == "keep" and self.head_modes and KEEP_STEP not in self.runs else profile)
        predicted = agree_bytes(rounded_peak(predicting, [choice] * len(profile.blocks), mode), self.device)
        return predicted <= self._budget(profile) * (1 - HEADROOM)

    def _sampled_peak(self, samples: dict[int, str]) -> int:
        """The sampled step's predicted peak: every recomputed phase's, plus the bytes kept by the
        sampled regions whose forward has run and whose backward has not finished by then."""

        def alive(phase: str | int, index: int) -> bool:
            if isinstance(phase, int):  # region ``phase``'s recompute and backward
                return phase >= index
            if phase.startswith("forward:"):
                return int(phase.partition(":")[2]) > index
            return phase != "stem"

        return max((size + sum(self.saved.get(index, 0) for index in samples if alive(phase, index))
                    for phase, size in self.phase_peaks.items()), default=0)

    def _explore_stored(self, choice: str, index: int, function: Callable[..., Any], args: tuple[Any, ...],
                        kwargs: dict[str, Any]) -> Any:
        """Run region ``index`` as ``choice`` (``offload:TIER``: its saved tensors through the step's
        shared schedule; ``recompute+offload:TIER``: recomputed, its input on the tier), measured."""
        measuring = self.measuring
        assert measuring is not None
        owner = self.session.sites[index].owner if index < len(self.session.sites) else None
        self.keys.setdefault(index, block_key(owner, args, kwargs) if owner is not None else index)
        if choice.startswith("recompute+offload"):
            options = choice_options(choice).replace(observer=_RegionMarks(index, measuring))
            return run_region_now(function, args, kwargs, options)
        if self._scope is None:
            self._scope = SharedOffload(choice.partition(":")[2], self.session.prefetch)
        engine.STATS.forward(function)
        measuring.region_forward(index)
        with self._scope:
            output = function(*args, **kwargs)
        measuring.region_forward_done(index)
        _mark_backward(output, index, measuring)
        return output

    def step_started(self) -> Plan | None:
        """At the start of the next training step (every rank at once): after the explored step,
        the plan every rank runs from now on; after a verification step, a plan solved again if it
        went over, else None (done measuring)."""
        if self.measuring is None:
            return None
        peak = agree_bytes(self.measuring.finish(), self.device)
        if self.exploring:
            choice, measured = self.step_choice, self.measuring
            if choice == "recompute":
                for phase, size in measured.phases.items():
                    self.phase_peaks[phase] = max(self.phase_peaks.get(phase, 0), size)
            self.runs.setdefault(choice, ChoiceSteps()).add(measured.phases, measured.held_after, measured.start_held,
                                                           measured.seconds)
            self.run_peaks[choice] = max(self.run_peaks.get(choice, 0), peak)
        self.measuring = None
        self._scope = None
        self.peaks.append(peak)
        session = self.session
        if self.exploring:
            self.explored += 1
            if self.explored >= len(self._order):
                self._next_step()
            if self.explored < len(self._order):
                self._run_outside("keep" if self.step_choice == KEEP_STEP else self._outside_mode)
                self._measure_next_step()
                return None
            self._run_outside("keep")  # the plan's own part outside is the session's
            self.exploring = False
            self.profile = self._profile(self.run_peaks[self.work])
            plan = self._solve_on_rank0(session.planned_budget, overhead=0)
        else:
            plan = session.plan
            plan.measured_process_peak = peak
            accept = int(plan.budget * (1 - HEADROOM))
            least = self._least_memory()
            if peak <= accept or self.verifications >= session.retries or plan.choices == least:
                self._say_verified(plan, peak)
                return None
            self.verifications += 1
            # what the prediction missed becomes room left for, as the single-process planner's overhead
            missed = max(0, peak - plan.peak)
            try:
                plan = self._solve_on_rank0(plan.budget, overhead=missed)
            except ValueError:  # (every rank alike) none fits with that room: the least there is
                plan = Plan.from_choices(plan, least)
                plan.overhead = missed
            plan.notes.append(f"solved again after a step measured {format_bytes(peak)} over the accepted "
                              f"{format_bytes(accept)}")
            if rank() == 0 and not session.api:
                print(f"acshim: --budget {format_bytes(plan.budget)}: the plan's step peaked at {format_bytes(peak)} "
                      f"(predicted {format_bytes(session.plan.peak + session.plan.overhead)}); solved again with "
                      f"the error added: {plan.describe()}", file=sys.stderr, flush=True)
        self._measure_next_step()
        return plan

    def explore_again(self) -> None:
        """This step (larger inputs than any planned for) runs every region recomputed and is
        measured; the next one gets a plan solved on it."""
        self._drop_measurement()
        self.saved, self.seconds, self.phase_peaks, self.kept_forward = {}, {}, {}, {}
        self.input_bytes, self.output_bytes = {}, {}
        self.runs, self.run_peaks, self.sampled_at, self.sampled_saved = {}, {}, {}, {}
        self.sampled_choices = sampled_choices(self.session)
        self._reset_steps()
        self.logits_bytes = 0
        self._run_outside(self._outside_mode)
        self.exploring, self.explored, self.verifications = True, 0, 0
        self._measure_next_step()

    def _measure_next_step(self) -> None:
        baseline = self.step_baseline
        if baseline is None:
            trim()
            baseline = self.memory.current()
        self.step_baseline = None
        self.measuring = StepPeak(self.memory, baseline)
        self.measuring.start(self.root)

    def stop(self) -> None:
        """Stop measuring and watching the steps (the session ends)."""
        self._outer.remove()
        if self._head_hook is not None:
            self._head_hook.remove()
            self._head_hook = None
        self._drop_measurement()
        self._run_outside("keep")

    def _run_outside(self, mode: str) -> None:
        """The part outside the regions run as ``mode`` (``keep`` or ``HEAD_MODE``) for the explored
        steps (a plan's own part outside is the session's)."""
        if (mode != "keep") != self._head_installed:
            install_outside(self.root, mode)
            self._head_installed = mode != "keep"

    def _drop_measurement(self) -> None:
        if self.measuring is not None:
            self.measuring.finish()
            self.measuring = None
        self._scope = None

    # ---------------------------------------------------------------------------------- solving
    def _profile(self, peak: int) -> Profile:
        """The explored steps as the solver's profile (``solver``'s peak formula: while region i
        runs, forward or backward, the kept regions before it hold what they saved). ``peak``: the
        recomputed steps' largest; a phase not seen counts as it. Without a storage or sampled
        choice (``_recomputed_blocks``) everything the recomputed steps held is in the phases; with
        one, each choice's held bytes are explicit (``_blocks_explored``, ``explored``)."""
        session = self.session
        names = site_names(self.root, session.sites)
        for name, site in zip(names, session.sites, strict=True):
            site.name = name
        session.names = names
        shared: dict[Any, list[float]] = {}
        for index, key in self.keys.items():
            shared.setdefault(key, []).append(self.seconds.get(index, 0.0))
        forwards = [statistics.median(shared.get(self.keys.get(index), [self.seconds.get(index, 0.0)]))
                    for index in range(len(names))]
        explored = [c for c in self.storage_choices if c in self.runs]
        sampled = self._sampled_offered(len(names))
        if explored or sampled:
            blocks, other_held, outside = self._blocks_explored(names, forwards, peak, explored, sampled)
        else:
            blocks, other_held, outside = self._recomputed_blocks(names, forwards, peak)
        owners = [(n, s.owner if s.owner is not None else self.root) for n, s in zip(names, session.sites, strict=True)]
        method = METHOD
        if self.base != "recompute":
            method = method.replace("every region recomputed", f"every region {self.base} (the least memory)")
        later = [choice for choice in self._order[EXPLORE_STEPS:] if choice not in (SAMPLED_STEP, KEEP_STEP)]
        if later:
            method = method.replace("the plan's first step", f"then one step each ran every region "
                                                             f"{' and '.join(later)}; the plan's first step")
        if self.skipped:
            method = method.replace("the plan's first step", f"not run, predicted over the budget: "
                                                             f"{', '.join(self.skipped)}"
                                    + (f" (recompute taken from {self.base} with its inputs held)"
                                       if "recompute" in self.skipped else "") + "; the plan's first step")
        if sampled:
            method = method.replace("the plan's first step", f"then one step ran one region of each kind "
                                                             f"{' and one '.join(sampled)}; the plan's first step")
        if self.head_modes:
            kept = ("then one step kept them" if KEEP_STEP in self.runs else
                    f"keeping them was predicted over the budget and not run: not offered, and no checkpointing's "
                    f"peak estimated with them holding {KEPT_LOGITS[0]} logits-sized tensors more "
                    f"({format_bytes(KEPT_LOGITS[0] * self.logits_bytes)})")
            method = method.replace("the plan's first step", "every step ran the LM head and loss in chunks "
                                                             f"(acshim.head, head mode), {kept}; the plan's first step")
        # rank 0's: FSDP1's flat-parameter shards give each rank different parameter shapes
        signature: list[Any] = [model_signature(self.root, owners)]
        dist.broadcast_object_list(signature, src=0)
        profile = Profile(blocks=blocks, choices=[*CHOICES, *sampled, *explored], other_held=other_held,
                          other_transient=outside, other_seconds=0.0, signature=signature[0],
                          prefetch=session.prefetch, method=method,
                          recompute_step={"saved": sum(self.saved.values()), "peak": peak})
        profile = self._with_outside(profile, peak, explicit=bool(explored or sampled))
        agreed = agree_profile(profile, self.device)
        agreed.method += f"; agreed across {dist.get_world_size()} ranks (each number the largest any rank measured)"
        return agreed

    def _recomputed_blocks(self, names: list[str], forwards: list[float], peak: int
                           ) -> tuple[list[BlockProfile], int, int]:
        """Keep and recompute from the recomputed steps alone: nothing is held outside the regions
        beyond what every phase measured; the phases outside the regions (stem, head, loss, the head's
        backward) are the outside part's transient, with every kept region's bytes held on top;
        region i's transient is the larger of its forward's and its recompute and backward's phase;
        kept, the larger of its forward's peak had it been kept (``SavedCounter.kept_peak``) and
        its backward's phase, less its own saved bytes (held in the prefix since its forward)."""
        phases = {phase: _rounded(size) for phase, size in self.phase_peaks.items()}
        blocks = []
        for index, name in enumerate(names):
            forward = forwards[index]
            saved = self.saved.get(index, 0)
            ahead, back = phases.get(f"forward:{index}", peak), phases.get(index, peak)
            kept = max(ahead, _rounded(self.kept_forward.get("recompute", {}).get(index, 0)))  # kept, it holds at least what recomputed did
            blocks.append(BlockProfile(name=name, held={"keep": saved, "recompute": 0},
                                       transient={"keep": max(0, max(kept, back) - saved),
                                                  "recompute": max(ahead, back)},
                                       seconds={"keep": (1 + BACKWARD_SHARE) * forward,
                                                "recompute": (2 + BACKWARD_SHARE) * forward},
                                       saved=saved))
        outside = max(phases.get("forward", peak), phases.get("head", peak), phases.get("stem", 0))
        return blocks, 0, outside

    def _with_outside(self, profile: Profile, peak: int, explicit: bool, most: bool = False) -> Profile:
        """``profile`` (its part outside the regions as the explored steps ran it: ``other_transient``)
        with that part's choices. Without a head, it is kept as measured. With one, those steps ran it
        as ``HEAD_MODE``: that is the profile's ``outside`` entry (held: what the stem leaves, the same
        either way); kept, it is what ``KEEP_STEP`` measured (with the regions' held bytes explicit:
        beyond them, ``ChoiceSteps.outside``; else every phase outside the regions), the head's time
        beyond it what the two took after the regions' forward (never less than nothing). Where that
        step did not run, keeping is not offered (``INFEASIBLE``) and no checkpointing's peak is
        estimated with it holding ``KEPT_LOGITS``' least beyond the head's (``unchecked_floor``);
        ``most``: offered at ``KEPT_LOGITS``' most (to predict that step)."""
        if not self.head_modes:
            return profile
        count, chunked = len(profile.blocks), profile.other_transient
        heads = {HEAD_MODE: {"held": profile.other_held, "transient": chunked, "seconds": 0.0}}
        kept = self.runs.get(KEEP_STEP)
        if kept is not None:
            top = self.run_peaks.get(KEEP_STEP, peak)
            keep = (rounded(kept.outside(count, kept.held(count), top), PHASE_UNIT) if explicit
                    else _rounded(max(kept.phases.get("forward", top), kept.phases.get("head", top),
                                      kept.phases.get("stem", 0))))
            spent = [sum(steps.seconds.get(phase, 0.0) for phase in ("forward", "head"))
                     for steps in (self.runs[self.work], kept)]
            heads[HEAD_MODE]["seconds"] = max(0.0, spent[0] - spent[1])
            return replace(profile, other_transient=keep, outside=heads)
        least, largest = (chunked + rounded(copies * self.logits_bytes, PHASE_UNIT) for copies in KEPT_LOGITS)
        estimated = replace(profile, other_transient=largest if most else least, outside=heads)
        if most:
            return estimated
        return replace(estimated, other_held=INFEASIBLE, unchecked_floor=reference(estimated)[0])

    def _sampled_offered(self, count: int) -> list[str]:
        """The ``SAMPLED`` choices every kind of region was run as, on every rank (a collective:
        every rank calls it)."""
        if not self.sampled_choices:
            return []
        kinds = {self.keys.get(index, index) for index in range(count)}
        covered = [SAMPLED_STEP in self.runs and kinds <= set(self.sampled_at.get(choice, {}))
                   for choice in self.sampled_choices]
        agreed = agree_every_rank(covered, self.device)
        return [choice for choice, offered in zip(self.sampled_choices, agreed, strict=True) if offered]

    def _blocks_explored(self, names: list[str], forwards: list[float], peak: int, explored: list[str],
                         sampled: list[str]) -> tuple[list[BlockProfile], int, int]:
        """Every choice's held bytes explicit (``explored``): recompute's and each storage choice's
        from its own step, keep's as recompute's plus what ``SavedCounter`` counted, a sampled
        choice's (``SAMPLED``) as recompute's plus what its kind's sampled region held, and had as
        transient, beyond the same region recomputed (held: never below recompute's; not above keep's
        where it was not counted); the part outside
        the regions holds the most any step held when its first region started. Times: keep and
        recompute as without storage choices; a storage choice adds what its step's region took
        beyond the same work recomputed (``offload``: beyond keep's, the recompute-and-backward
        phase; ``recompute+offload``: beyond recompute's), never less than nothing (measured
        faster is noise); a sampled choice's is recompute's less what its sampled region took less than
        recomputed, never below keep's. The ``offload`` schedule's resident window: what the first offloaded region
        left behind in its step (``Profile.window`` adds the copies in flight). Each region keeps its
        own numbers (the first region's input may be held by the part before it)."""
        count = len(names)
        keys = [self.keys.get(index, index) for index in range(count)]
        work = self.work
        recomputed = self.runs[work]
        measured = {choice: self.runs[choice].held(count) for choice in dict.fromkeys([work, *explored])}
        resident = {choice: list(sizes) for choice, sizes in measured.items()}
        """What each step's regions left behind, the offload window included: resident while the
        part outside the regions runs, so its transient is taken above it (the solver adds the
        window back to the outside part wherever a plan offloads, ``solver``'s peak formula)."""
        window = 0
        for choice in explored:
            if choice.startswith("offload") and measured[choice]:
                # the first offloaded region's growth is the schedule's resident window (each later
                # one sends the previous window out and leaves its own): the window, not its held bytes
                window = rounded(measured[choice][0], HELD_UNIT)
                measured[choice][0] = 0
        held = {choice: [rounded(size, HELD_UNIT) for size in sizes] for choice, sizes in measured.items()}
        transient = {choice: self.runs[choice].transients(count, sizes, peak, PHASE_UNIT)
                     for choice, sizes in measured.items()}
        if work != "recompute":
            # recompute's step did not fit the budget: derived from the base's (recompute+offload),
            # whose regions moved their inputs to the tier: a recomputed region leaves its output
            # behind (the next one's input), and its backward fetches nothing back (the base's
            # transient less the region's input)
            inputs = [self.input_bytes.get(index, 0) for index in range(count)]
            measured["recompute"] = [max(size, self.output_bytes.get(index, 0))
                                     for index, size in enumerate(measured[work])]
            held["recompute"] = [rounded(size, HELD_UNIT) for size in measured["recompute"]]
            transient["recompute"] = [rounded(size - inputs[index], PHASE_UNIT)
                                      for index, size in enumerate(transient[work])]
        steps = resident  # what each explored step held per region (the sampled one's mixed)
        if sampled:
            steps[SAMPLED_STEP] = self.runs[SAMPLED_STEP].held(count)
            sampled_transient = self.runs[SAMPLED_STEP].transients(count, steps[SAMPLED_STEP], peak, PHASE_UNIT)
        saved = [self.saved.get(index, 0) for index in range(count)]
        kept_prefix, kept, kept_forward = 0, [], self.kept_forward.get(work, {})
        for index in range(count):
            kept_prefix += measured[work][index]  # what work's step held up to it, above which keep adds
            top = max(_rounded(kept_forward.get(index, 0)), recomputed.phases.get(f"forward:{index}", peak),
                      recomputed.phases.get(index, peak))
            kept.append(rounded(top - recomputed.start - kept_prefix - saved[index], PHASE_UNIT))
        plain = median_per_key([recomputed.region_seconds(index) for index in range(count)], keys)
        backs = median_per_key([recomputed.seconds.get(index, 0.0) for index in range(count)], keys)
        extra = {choice: median_per_key([self.runs[choice].region_seconds(index) for index in range(count)], keys)
                 for choice in explored}
        blocks = []
        for index, name in enumerate(names):
            keep_seconds, recompute_seconds = (1 + BACKWARD_SHARE) * forwards[index], (2 + BACKWARD_SHARE) * forwards[index]
            block = BlockProfile(name=name, held={"keep": saved[index] + held["recompute"][index],
                                                  "recompute": held["recompute"][index]},
                                 transient={"keep": kept[index], "recompute": transient["recompute"][index]},
                                 seconds={"keep": keep_seconds, "recompute": recompute_seconds},
                                 saved=self.saved.get(index, 0))
            for choice in explored:
                offloaded = choice.startswith("offload")
                base = keep_seconds if offloaded else recompute_seconds
                beyond = extra[choice][index] - (backs[index] if offloaded else plain[index])
                block.held[choice], block.transient[choice] = held[choice][index], transient[choice][index]
                block.seconds[choice] = base + max(0.0, beyond)
                if offloaded:
                    block.window[choice] = window
            for choice in sampled:
                at = self.sampled_at[choice][keys[index]]
                # it holds its input, as recompute, and the outputs its policy saved: counted (some of
                # them keep would not save, a matmul output added to the residual), else what the
                # sampled region's forward left behind beyond recompute's, a page-noisy figure kept
                # within keep's
                more = self.sampled_saved.get(choice, {}).get(keys[index])
                ceiling = INFEASIBLE if more is not None else block.held["keep"]
                if more is None:
                    more = steps[SAMPLED_STEP][at] - measured["recompute"][at]
                block.held[choice] = min(ceiling, max(held["recompute"][index],
                                                      rounded(measured["recompute"][index] + more, HELD_UNIT)))
                block.transient[choice] = max(0, transient["recompute"][index] + sampled_transient[at]
                                              - transient["recompute"][at])
                faster = self.runs[SAMPLED_STEP].region_seconds(at) - plain[at]
                block.seconds[choice] = min(recompute_seconds, max(keep_seconds, recompute_seconds + faster))
            blocks.append(block)
        other_held = rounded(max(self.runs[step].start for step in steps), PHASE_UNIT)
        outside = max(rounded(self.runs[step].outside(count, sizes, peak), PHASE_UNIT) for step, sizes in steps.items())
        return blocks, other_held, outside

    def _solve_on_rank0(self, budget: Any, overhead: int) -> Plan:
        """Rank 0 solves, every rank gets its plan (or its error, raised on every rank alike)."""
        payload: list[Any] = [None]
        if rank() == 0:
            try:
                payload[0] = solve_within(self.profile, budget, None, overhead=overhead).to_json()  # type: ignore[arg-type]
            except BudgetTooSmall as error:
                payload[0] = {"error": self._too_small(error)}
            except ValueError as error:
                payload[0] = {"error": str(error)}
        dist.broadcast_object_list(payload, src=0)
        data = payload[0]
        if "error" in data:
            raise ValueError(data["error"])
        return Plan.from_json(data)

    def least_plan(self, previous: Plan) -> Plan:
        """The least-memory plan (``_least_memory``, the part outside the regions kept) of the profile
        the last explored steps gave, with ``previous``'s budget: what a run goes on under where a
        plan for larger inputs was refused (every rank alike: the profile is agreed)."""
        assert self.profile is not None
        return Plan.from_choices(replace(previous, profile=self.profile, blocks=[b.name for b in self.profile.blocks]),
                                 self._least_memory())

    def _least_memory(self) -> list[str]:
        """Per region, the choice holding least (then with the least transient): every region
        recomputed, or with a storage choice, what holds less."""
        assert self.profile is not None
        return [min(self.profile.choices, key=lambda c, b=b: (b.held[c], b.transient[c])) for b in self.profile.blocks]

    def _too_small(self, error: BudgetTooSmall) -> str:
        least = minimum_peak(self.profile) if self.profile is not None else error.minimum
        choices = self.profile.choices if self.profile is not None else CHOICES
        suggested = (max(error.suggested, int(error.minimum * (1 + SUGGESTION_MARGIN))) if error.minimum < INFEASIBLE
                     else error.suggested)
        return (f"budget {format_bytes(error.budget)} is below the least any plan of {', '.join(choices)} needs: "
                f"{format_bytes(least)} above the step's start on the largest rank, as its explored steps ran; "
                f"pass --budget {budget_at_least(suggested)} or more")

    def _say_verified(self, plan: Plan, peak: int) -> None:
        if rank() == 0 and not self.session.api:
            within = "within" if peak <= plan.budget else "OVER"
            print(f"acshim: --budget {format_bytes(plan.budget)}: the plan's step peaked at {format_bytes(peak)} "
                  f"({peak / plan.budget:.2f} of the budget, {within} it) on the largest rank",
                  file=sys.stderr, flush=True)
