"""Profile a model's checkpointed regions per choice within the budget, and verify a candidate plan.

``RegionProfiler`` works through a ``PlanSession`` (which routes the model's region calls, by their
position in the step, to whatever the current measurement needs) and never runs the model without
checkpointing:

1. **Count** (forward only): every saved tensor is counted by storage under the region (or the part
   outside the regions) that saved it, and not kept (``counting.SavedBytes``): no plan is needed to
   learn what no checkpointing would hold, and a fractional budget gets its bytes from it. Each
   region's input is copied once per distinct region (class, parameter and input shapes: identical
   blocks share their measurements); its output is reduced to shapes (``replay.spec_of``).
2. **Outside**: the part outside the regions runs forward and backward with every region replaying an
   output of the recorded shapes (``replay.replay_spec``): its held bytes, transient and time, kept
   and per offload tier offloaded.
3. **Regions**: each distinct region runs alone once per choice, on a copy of its input, least memory
   first (offload, recompute+offload, recompute, selective-alt, selective, keep): held bytes,
   transient and an operator-by-operator timing (``costs``).
4. **Verify** (``verify``): one step of the model under a candidate plan, tracked and measured as the
   process sees it.

Everything runs under one ``process.Guard``: the process's memory above the step's start is sampled
after every operator, and a measurement that goes over the budget is stopped there. Its choice is
``INFEASIBLE`` (the measurement is part of any plan using the choice, so none fits), and the
choices that need more memory than it for the same region are not tried. So planning holds, at
any moment, what the step held when it was interrupted plus one measurement, never more than the
budget.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from .. import head, structures
from ..region_state import region_inputs
from ..selective import OffloadProbe
from ..storage.reaper import REAPER
from .choices import (
    ASKED,
    SharedOffload,
    install_outside,
    is_offload,
    moves_data,
    offload_scopes,
    split_outside,
)
from .costs import OpTimes, RunTime, Stopwatch
from .counting import OUTSIDE, SavedBytes
from .planning_loss import planning_loss, script_loss_allowance
from .process import Guard, OverBudget, ProcessMemory, guard_limit, release_stopped, trim
from .profile import (
    INFEASIBLE,
    BlockProfile,
    ChoiceMeasurement,
    Profile,
    block_key,
    feasible,
    grad_flags,
    measure_choice,
    with_copies_in_flight,
)
from .replay import Copies, replay_spec, spec_of
from .routing import Mode, PlanningContext
from .tracker import LiveBytes, excluded_keys, grad_keys

ORDER = (("recompute", "selective-alt", "selective", "keep"), ("offload", "recompute+offload"), (ASKED,))
"""Choices measured per region, in groups from least to most memory: once one goes over the budget,
those after it in its group are not tried (they hold more, and their peak alone is no lower). The
computing choices come first: a storage tier's first real copies leave the process a little larger
for good (worker threads' heaps), which would otherwise be charged to every measurement after them."""


DEFERRED = {"recompute+offload": ("recompute", "offload")}
"""Choices measured only when a plan may use them, with the two measured choices that bound them
(``RegionProfiler.optimistic``): ``recompute+offload`` holds at least nothing, is no faster than
``recompute`` (the same recompute, and copies), and peaks at least at the lesser of recompute's
transient and offload's (or the copies in flight its forward meets, if more). Planning skips a
measurement of a block alone (a seventh of a step on GPT-2 8x512) whenever no plan within reach
would take it.
(``selective-alt`` has no bound tight enough: held as little as recompute and as fast as selective,
it would be taken, and measured, wherever selective is close.)"""


OUTSIDE_BOUNDS = 6
"""A chunked head or loss (``acshim.head``) is measured only when a plan within reach could take it,
with these lower bounds from the same outside part without it: it holds at least that less all the
outside part saves, peaks at least that less this many copies of the logits (the logits, their
upcast or shifted copy, the log-softmax, and in backward their gradients: what chunking avoids), and
runs no faster. Where the vocabulary is small (GPT-2 8x512 here: 1 MiB of logits) no plan takes it
and four measurements of the outside part are skipped."""


@dataclass
class Verification:
    """One step of the model under a candidate plan: the tracker's held and peak bytes, the process's
    peak above the step's start (``None`` where the process cannot be read), its time, and whether
    the guard stopped it (then ``process_peak`` is where it stopped)."""

    held: int
    peak: int
    process_peak: int | None
    seconds: float
    stopped: bool = False
    live_at_stop: int = 0
    """Where the guard stopped it: the activation bytes the tracker counted live then."""


class RegionProfiler:
    """Measurements of ``session``'s model within ``limit`` bytes above ``baseline`` (see the module
    docstring). Enter it to start the guard; ``limit`` may be set later (a fractional budget)."""

    def __init__(self, session: PlanningContext, root: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 loss_fn: Callable[[Any], torch.Tensor] | None, memory: ProcessMemory, baseline: int,
                 limit: int | None, file_baseline: int | None = None) -> None:
        # Measurements run forward and backward many times: on the script's own inputs their
        # backwards would reach the leaves those inputs come from (an input that requires grad, the
        # tensor a pipeline stage received) and add into their .grad, which the script then reads.
        args, kwargs = detached_inputs((args, kwargs))
        self.session, self.root, self.args, self.kwargs = session, root, args, kwargs
        self.loss_fn = loss_fn
        self.script_loss: int | None = None
        """What the script's own loss is charged until measured (``script_loss_allowance``), from
        the first step run here; None before it, or with a ``loss_fn``."""
        self.memory = memory
        self.guard = Guard(memory, baseline, None if limit is None else guard_limit(limit),
                           None if limit is None else file_baseline)
        self.file_baseline = file_baseline
        """Where the guard counts code paged in from once the budget is known (``set_limit``); the
        counting step's lower bounds are of tensors alone, and leave it out."""
        self.times = OpTimes()
        self.copies = Copies()
        self.saved: SavedBytes | None = None
        self.keys: dict[Any, int] = {}
        self._offloading: dict[Any, bool] = {}
        """Per kind of region (code, owner, shapes): whether the last one's policy offloaded."""
        self.excluded = excluded_keys(root, (args, kwargs))
        self.tracker: LiveBytes | None = None
        self.stops: dict[str, int] = {}
        """Per part that could not be measured within the budget, what the process held when stopped."""
        self.reached: dict[Any, int] = {}
        """Per measurement that completed (``"count"``, ``("outside", choice)``, ``(region key,
        choice)``), the most the process held above the step's start while it ran (``needed_for``)."""
        self._window_start = 0
        self._measured: dict[Any, tuple[BlockProfile, dict[str, ChoiceMeasurement], Any]] = {}
        """Per distinct region: its profile (shared by identical ones), measured runs, site."""
        self._pending: dict[Any, set[str]] = {}
        self.pending_outside: set[str] = set()
        """Outside choices with a chunked head or loss not measured yet (``defer_outside``)."""
        self.logits_bytes = 0
        """The LM head's output in the counting step (0: none ran)."""
        self._choices: list[str] = []

    # ---------------------------------------------------------------------------------- lifetime
    def __enter__(self) -> RegionProfiler:
        # What the script holds is no garbage of planning's: frozen, the collections between
        # measurements walk only what planning made (a full collection walked every object of a
        # transformers process: 0.15 s, a tenth of a GPT-2 step). Not if the script froze its own.
        self._froze = gc.get_freeze_count() == 0
        if self._froze:
            gc.freeze()
        if self.memory.available:
            self.guard.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self.memory.available:
            self.guard.__exit__(*exc_info)
        if self._froze:
            gc.unfreeze()

    def set_limit(self, limit: int, bound: bool = False) -> None:
        """Stop measurements at ``limit`` (less the guard's margin, and the code paged in since the
        step's start), or with ``bound`` at a lower bound of the budget in tensors' bytes (the
        counting step's, before the budget is known: code paged in is not part of it)."""
        self.guard.limit = guard_limit(limit)
        self.guard.file_baseline = None if bound else self.file_baseline

    def used(self) -> int:
        """The process's memory above the step's start now (0 where it cannot be read, or where the
        process holds less than then: what a plan is charged besides its activations is never less
        than nothing)."""
        return max(0, self.guard.used()) if self.memory.available else 0

    def drop_copies(self) -> None:
        """Free the regions' captured inputs (done before verifying: they are no part of a step), and
        the garbage profiling left, so that what the process holds now (the overhead the solver
        leaves room for) is the same from one run to the next."""
        for site in self.session.sites:
            site.captured = None
        self.copies = Copies()
        gc.collect()
        REAPER.settle(timeout=10.0)  # tier slots and read buffers of dead handles: freed on another thread
        trim()

    def step(self, tracker: LiveBytes | None = None, backward: bool = True) -> None:
        """One step of the model on the interrupted step's inputs."""
        self.session.position = 0
        output = self.root(*self.args, **self.kwargs)
        if self.loss_fn is None and self.script_loss is None:
            self.script_loss = script_loss_allowance(output, self.args, self.kwargs)
        loss = self.loss_fn(output) if self.loss_fn is not None else planning_loss(output, self.args, self.kwargs)
        del output
        if tracker is not None:
            tracker.mark("forward")
        if backward:
            loss.backward()
        del loss

    def _settle(self, schedules: dict[str, SharedOffload] | None = None) -> None:
        """After a measurement the guard stopped: wait for copies still in flight to a tier through its
        offload ``schedules`` (they hold memory), drop the aliases' gradients and collect the stopped
        step's garbage."""
        for scope in list((schedules or {}).values()):
            try:
                scope.session.raise_write_errors(wait=True)
            except OSError:
                pass
        self.root.zero_grad(set_to_none=True)
        gc.collect()
        REAPER.settle(timeout=10.0)
        trim()

    # ---------------------------------------------------------------------------------- 1. count
    def count(self, fraction: float | None = None) -> None:
        """The forward-only counting step (see the module docstring). ``fraction``: the budget is that
        share of no checkpointing's peak, not known yet; no checkpointing would hold what has been
        counted so far on top of what this step holds, so the step is stopped once it holds more than
        ``fraction / (1 - fraction)`` of the counted bytes (beyond what the interrupted step's first
        part, which it repeats, took). ``OverBudget`` if stopped: one forward, keeping nothing,
        already needs more than the budget can be."""
        self.guard.open_window("one forward of the model, keeping nothing")
        saved = SavedBytes(set(self.excluded))
        if fraction is not None:
            start = self.guard.last
            floor = max(2 * start, 1 << 20)
            share = fraction / max(1e-9, 1 - fraction)
            # Only outside the regions: a region's forward holds what it is about to save (no
            # checkpointing holds that too), and no plan runs without one block's forward.
            self.guard.limit = lambda: start + floor + int(share * saved.total()) if saved.owner == OUTSIDE else None
        stopped = None
        with self.session.routing(Mode.COUNT), saved:
            self.saved = saved
            chunked = head.available(self.root)  # the logits need not exist in a plan: nor here
            watch = None
            if chunked:
                install_outside(self.root, "head")
                watch = head.find_head(self.root).register_forward_hook(self._note_logits)  # type: ignore[union-attr]
            try:
                self.step(backward=False)
            except OverBudget as error:
                owner = getattr(error, "region", OUTSIDE)  # count_region notes it (its owner is reset by then)
                where = ("the part outside the blocks (embeddings, head, loss)" if owner == OUTSIDE
                         else f"region {owner}")
                stopped = (error.used, error.operator, error.size, where)
                release_stopped(error)
            finally:
                self.saved = None
                if chunked:
                    install_outside(self.root, "keep")
                if watch is not None:
                    watch.remove()
        self.counted = saved
        if stopped is None:
            self.reached["count"] = self.guard.window_peak
        if stopped is not None:  # outside the except block: the stopped step's frames are gone
            self._settle()
            self.stops["forward"] = stopped[0]
            raise OverBudget(stopped[0], self.guard.current_limit() or 0, stopped[3], stopped[1], stopped[2])

    def _note_logits(self, module: nn.Module, args: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor):
            self.logits_bytes = max(self.logits_bytes, output.numel() * output.element_size())

    def fraction_limit_for_outside(self, fraction: float, least: int = 0) -> None:
        """While the part outside the regions is measured and the budget is a share of no
        checkpointing's peak: that peak holds every region's saved bytes while this part runs, so
        this part may hold ``fraction`` of those and of its own high-water mark (and at least
        ``least``, a lower bound of the budget known already)."""
        regions = sum(site.saved for site in self.session.sites)
        self.guard.limit = lambda: max(least, int(fraction * (regions + max(0, self.guard.window_peak
                                                                            - self._window_start))))

    def count_region(self, index: int, function: Callable[..., Any], args: tuple[Any, ...],
                     kwargs: dict[str, Any], site: Any) -> Any:
        """Region ``index`` in the counting step: run with grad, its saved tensors counted and not
        kept; its input copied if no identical region came before; its output detached (so its
        graph goes at once) and reduced to shapes for the replay. A region given a selective-checkpoint
        policy runs under ``OffloadProbe``: where the policy offloads, it runs as the script asked
        (``site.as_asked``) and is distinct from identical regions that do not."""
        args, kwargs = region_inputs(function, args, kwargs)
        base = (_code_of(function), block_key(site.owner if site.owner is not None else nn.Module(), args, kwargs))
        probe = OffloadProbe.of(site.asked_options.context_fn) if site.asked_options is not None else None
        guess = (base, self._offloading.get(base, False))  # as the last identical region's policy did
        captured = (*self.copies((args, kwargs)), grad_flags((args, kwargs))) if guess not in self.keys else None
        saved = self.saved
        assert saved is not None
        saved.owner = index
        start = time.perf_counter()
        try:
            with probe if probe is not None else contextlib.nullcontext():
                output = function(*args, **kwargs)
        except OverBudget as error:
            error.region = index  # type: ignore[attr-defined]
            raise
        finally:
            saved.owner = OUTSIDE
        site.as_asked = self._offloading[base] = probe is not None and probe.offloads
        site.key = key = (base, site.as_asked)
        if key not in self.keys:
            self.keys[key] = index
            # guessed wrong: its inputs now (a region that changes its inputs in place is measured
            # a little off; measurements run on copies, the script's step is not touched)
            site.captured = captured if key == guess else (*self.copies((args, kwargs)), grad_flags((args, kwargs)))
        site.forward_seconds = time.perf_counter() - start
        site.saved = saved.bytes.get(index, 0)
        site.spec = spec_of(output)
        leaves, rebuild = structures.flatten(output)
        return rebuild([leaf.detach().requires_grad_(leaf.requires_grad) if isinstance(leaf, torch.Tensor) else leaf
                        for leaf in leaves])

    # ---------------------------------------------------------------------------------- 2. outside
    def replay_region(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        output = replay_spec(self.session.sites[index].spec, args, kwargs)
        if index == len(self.session.sites) - 1 and self.tracker is not None:
            _mark_when_reached(output, self.tracker, "head")
        return output

    def outside(self, choice: str) -> dict[str, float]:
        """``held``, ``transient`` (up to the head's backward: the embeddings' backward runs when the
        blocks hold nothing) and ``seconds`` of the part outside the regions run as ``choice``,
        ``INFEASIBLE`` held bytes if it went over the budget."""
        session = self.session
        self.guard.open_window(f"the part outside the regions ({choice})")
        self._window_start = self.guard.last
        install_outside(self.root, choice, session.prefetch, {})
        tracker = LiveBytes(set(self.excluded), timed=True)
        self.tracker = tracker
        self.root.zero_grad(set_to_none=True)
        stopped = False
        try:
            with session.routing(Mode.REPLAY), tracker:
                with Stopwatch() as watch:
                    self.step(tracker)
                tracker.mark("end")
        except OverBudget as error:
            release_stopped(error)
            stopped = True
        finally:
            self.tracker = None
            install_outside(self.root, "keep")
            self.root.zero_grad(set_to_none=True)
        if stopped:  # outside the except block: the stopped step's frames are gone with its traceback
            tracker.release()
            self.stops[f"outside {choice}"] = self.guard.window_peak
            self._settle()
            return {"held": INFEASIBLE, "transient": INFEASIBLE, "seconds": float("inf")}
        self.reached[("outside", choice)] = self.guard.window_peak
        series = tracker.series(grad_keys(self.root))
        tracker.release()
        held = series[tracker.marks["forward"] - 1]
        head = max(tracker.marks.get("head", len(series)), tracker.marks["forward"])
        # what is left once the head's backward is over, when the blocks' backward begins, less the
        # gradient it reaches them with (each block's own measurement counts its incoming gradient)
        back = min(held, max(0, series[head - 1] - tracker.reached.get("head", 0))) if "head" in tracker.marks \
            else held
        run = RunTime(watch.wall, tracker.own_seconds, tracker.durations, watch.other_cpu)
        self.times.observe_run(run, moves_data=is_offload(choice))
        return {"held": held, "back": back, "transient": max(0, max(series[:head]) - held),
                "seconds": run.estimate(self.times, moves_data=is_offload(choice), alone=True)}

    # ---------------------------------------------------------------------------------- 3. regions
    def regions(self, choices: list[str], names: list[str], defer: bool = False) -> list[BlockProfile]:
        """Each distinct region alone, per choice (see the module docstring). With ``defer``, a choice
        that ``DEFERRED`` bounds by two measured ones is not measured yet (``pending``): its block
        profiles hold it as ``INFEASIBLE`` until ``measure_pending`` runs it."""
        self._choices = list(choices)
        profiles: list[BlockProfile] = []
        fresh: list[tuple[BlockProfile, Any]] = []
        for name, site in zip(names, self.session.sites, strict=True):
            if site.key in self._measured:
                first = self._measured[site.key][0]
                profiles.append(BlockProfile(name, first.held, first.transient, first.seconds, first.name,
                                             first.window, site.saved, first.forward))  # the first one's tables
                continue
            profile = BlockProfile(name, {c: INFEASIBLE for c in choices}, {c: INFEASIBLE for c in choices},
                                   {c: float("inf") for c in choices}, window={c: 0 for c in choices},
                                   saved=site.saved)
            self._measured[site.key] = (profile, {}, site)
            profiles.append(profile)
            fresh.append((profile, site))
        # One group of choices at a time over every distinct region (``ORDER``): a storage tier's
        # first real copies leave the process larger for good, so no computing choice is measured
        # after any region's offload; and within the offloading group the region whose computing
        # choices needed most goes first, while the process holds least (README's train.py at
        # 0.5 with two threads: block 1, whose input needs a gradient, went over by 0.05 MiB when
        # measured after block 0's offload had left the disk tier's 2.2 MiB resident).
        over: dict[Any, dict[int, int]] = {}  # per region and group, the least rank that went over
        for group in range(len(ORDER)):
            for profile, site in sorted(fresh, key=lambda found: -_need(found[0])) if group else fresh:
                # a region the script's offload policy runs is measured so, and only so (choices.ASKED)
                own = [ASKED] if site.as_asked else [c for c in choices if c != ASKED]
                later = [c for c in own if defer and _bounds_of(c, choices)]
                mine = [c for c in own if _memory_rank(c)[0] == group]
                failed = over.setdefault(site.key, {})
                for choice in [*sorted((c for c in mine if c not in later), key=_memory_rank),
                               *(c for c in later if c in mine)]:
                    rank = _memory_rank(choice)[1]
                    if failed.get(group, rank) < rank:  # one of its group needing less memory already went over
                        continue
                    bounds = _bounds_of(choice, choices) if choice in later else None
                    if bounds and all(feasible(profile, b) for b in bounds):
                        self._pending.setdefault(site.key, set()).add(choice)
                        continue
                    if not self._measure(site.key, choice):
                        failed[group] = min(failed.get(group, rank), rank)
        self._estimate_seconds()
        return profiles

    def pending(self) -> set[str]:
        """Choices not measured as yet: some distinct region's (``regions(defer=True)``) and the outside
        part's (``defer_outside``)."""
        return set().union(*self._pending.values(), self.pending_outside)

    def defer_outside(self, outside: dict[str, dict[str, float]], parts: list[str]) -> None:
        """Leave ``parts`` (outside choices with a chunked head or loss) unmeasured for now: ``INFEASIBLE``
        in ``outside`` until ``measure_pending`` runs them."""
        for part in parts:
            outside[part] = {"held": INFEASIBLE, "transient": INFEASIBLE, "seconds": float("inf")}
        self.pending_outside |= set(parts)

    def measure_pending(self, profile: Profile, wanted: set[str] | None = None) -> None:
        """Measure the pending choices (those in ``wanted``; all by default) into ``profile``: every
        distinct region's, and the outside part's."""
        for part in sorted(self.pending_outside & wanted if wanted is not None else set(self.pending_outside)):
            self.pending_outside.discard(part)
            profile.outside[part] = self.outside(part)
        for key, pending in list(self._pending.items()):
            for choice in sorted(pending & wanted if wanted is not None else set(pending), key=_memory_rank):
                pending.discard(choice)
                self._measure(key, choice)
            if not pending:
                del self._pending[key]
        self._estimate_seconds()

    def measure_stopped(self, profile: Profile, limit: int) -> None:
        """Measure into ``profile`` again, stopping at ``limit`` (a budget above the one that stopped
        them), the parts of which no choice was measured within the budget: the part outside the
        regions (its other choices, then kept) and each distinct region (every choice). A refusal's
        last step, so that the least budget it names is the frontier's own (which plans), not a
        multiple of how far a stopped measurement got; parts already measured one way keep their
        measurements (the least plan uses their least choice)."""
        self.set_limit(limit)
        if not profile.outside_choices():
            for part, found in sorted(profile.outside.items()):
                if found["held"] >= INFEASIBLE and part not in self.pending_outside:
                    profile.outside[part] = self.outside(part)
        if not profile.outside_choices() and profile.other_held >= INFEASIBLE:
            kept = self.outside("keep")
            profile.other_held, profile.other_transient = int(kept["held"]), int(kept["transient"])
            profile.other_seconds, profile.other_back = kept["seconds"], int(kept.get("back", kept["held"]))
        for key, (block, runs, site) in self._measured.items():
            if site.captured is None or any(feasible(block, c) for c in block.held):
                continue
            own = [ASKED] if site.as_asked else [c for c in self._choices if c != ASKED]
            left = self._pending.get(key, set())
            for choice in sorted((c for c in own if c not in runs and c not in left), key=_memory_rank):
                self._measure(key, choice)
        self._estimate_seconds()
        profile.stops = dict(self.stops)

    def optimistic(self, profile: Profile) -> Profile:
        """``profile`` with each pending choice at a lower bound of what measuring it could give
        (``DEFERRED``, ``OUTSIDE_BOUNDS``): a plan solved on it that uses no pending choice is the plan
        measuring them all would give."""
        if not self._pending and not self.pending_outside:
            return profile
        bounded = {id(self._measured[key][0].held): (pending, self._measured[key][2])
                   for key, pending in self._pending.items()}
        blocks = []
        for block in profile.blocks:
            pending, site = bounded.get(id(block.held), (set(), None))
            held, transient, seconds = dict(block.held), dict(block.transient), dict(block.seconds)
            for choice in pending:
                recompute, offload = _bounds_of(choice, profile.choices)  # type: ignore[misc]
                in_flight = _in_flight(site)
                held[choice], seconds[choice] = 0, block.seconds[recompute]
                transient[choice] = min(block.transient[recompute], max(block.transient[offload], in_flight))
            blocks.append(replace(block, held=held, transient=transient, seconds=seconds, window=dict(block.window)))
        outside = dict(profile.outside)
        for part in self.pending_outside:
            rest = split_outside(part)[0]
            base_held, base_transient, base_seconds = profile.other(rest)
            outside[part] = {"held": max(0, base_held - profile.other_saved),
                             "transient": max(0, base_transient - OUTSIDE_BOUNDS * self.logits_bytes),
                             "seconds": base_seconds}
        return replace(profile, blocks=blocks, outside=outside)

    def _measure(self, key: Any, choice: str) -> bool:
        """Region ``key`` alone as ``choice`` into its profile; False if it went over the budget."""
        profile, runs, site = self._measured[key]
        found = self._alone(site, choice)
        if found is None:
            return False
        runs[choice] = found
        self.reached[(key, choice)] = self.guard.window_peak
        self.times.observe_run(found.run, moves_data=moves_data(choice))
        in_flight = _in_flight(site) if moves_data(choice) else 0
        profile.held[choice], profile.transient[choice] = found.held, with_copies_in_flight(found, in_flight)
        profile.window[choice] = found.window
        if in_flight:
            profile.forward[choice] = found.forward
        return True

    def needed_for(self, choices: list[str], outside: str) -> int:
        """The most the process held, above the step's start, in any measurement planning needs for
        a plan of ``choices`` / ``outside``: the counting forward, the outside part as ``outside``,
        each distinct region alone as its choice (0 where not measured here: a reused profile). A
        budget below it stops one of them, however little the plan itself would hold."""
        keys = [site.key for site in self.session.sites]
        needs = [self.reached.get("count", 0), self.reached.get(("outside", outside), 0)]
        needs += [self.reached.get((key, choice), 0) for key, choice in zip(keys, choices, strict=False)]
        return max(needs)

    def _estimate_seconds(self) -> None:
        """Every measured choice's seconds from the cost model as calibrated by all runs so far."""
        for profile, runs, _ in self._measured.values():
            kept = runs["keep"].run if "keep" in runs else None
            profile.seconds.update({c: runs[c].run.estimate(self.times, moves_data=moves_data(c), alone=True, kept=kept)
                                    for c in runs})

    def _alone(self, site: Any, choice: str) -> ChoiceMeasurement | None:
        session = self.session
        args, kwargs, flags = site.captured
        self.guard.open_window(f"region {site.name} as {choice}")
        offload = SharedOffload(choice.partition(":")[2], session.prefetch) if is_offload(choice) else None
        schedules = {offload.storage: offload} if offload is not None else {}  # a fresh schedule per measurement
        found = None
        REAPER.settle(timeout=10.0)  # what the last measurement's copies held: released, not counted here
        try:
            with session.routing(Mode.ALONE, schedules=schedules):
                found = measure_choice(functools.partial(_run_as, session, site, choice), args, kwargs,
                                       flags, excluded_keys(self.root, (args, kwargs)),
                                       functools.partial(grad_keys, self.root),
                                       functools.partial(self.root.zero_grad, set_to_none=True), offload)
        except OverBudget as error:
            release_stopped(error)
        finally:
            if found is None:
                self.stops[f"region {site.name}"] = max(self.stops.get(f"region {site.name}", 0), self.guard.window_peak)
                self._settle(schedules)
        return found

    # ---------------------------------------------------------------------------------- 4. verify
    def verify(self, choices: list[str], outside: str, in_flight: int = SharedOffload.IN_FLIGHT) -> Verification:
        """One step under ``choices`` / ``outside`` (``in_flight``: ``Plan.in_flight``), timed and
        measured as the process sees it (by the storage tracker too where the process cannot be read,
        or ``memory="tensors"``: the tracker would cost this step a tenth of its time for numbers the
        budget is not about)."""
        session = self.session
        schedules = offload_scopes(choices, outside, session.prefetch, in_flight)
        self.guard.open_window("one step of the model under the candidate plan")
        self.root.zero_grad(set_to_none=True)
        tracked = not self.memory.available
        tracker: Any = LiveBytes(set(self.excluded), timed=True) if tracked else _ProcessMarks(self.guard)
        stopped, guarding = False, self.guard.own_seconds
        with session.routing(Mode.MEASURE, candidate=choices, schedules=schedules):
            session.run_outside(self.root, outside, schedules)
            try:
                with tracker:
                    with Stopwatch() as watch:
                        self.step(tracker)
                        for scope in schedules.values():  # copies still in flight are part of the step
                            scope.session.raise_write_errors(wait=True)
                    tracker.mark("end")
                if self.memory.available:
                    self.guard.sample()
            except OverBudget as error:
                release_stopped(error)
                stopped = True
            finally:
                session.run_outside(self.root, "keep")
        process_peak = self.guard.window_peak if self.memory.available else None
        if stopped:  # outside the except block: the stopped step's frames are gone with its traceback
            live = tracker.series(set())[-1] if tracked and tracker.events else 0
            tracker.release()
            self._settle(schedules)
            return Verification(INFEASIBLE, INFEASIBLE, process_peak, float("inf"), stopped=True, live_at_stop=live)
        self.root.zero_grad(set_to_none=True)
        if not tracked:  # the guard's own time left out: plans with more operators pay more of it
            unguarded = max(0.0, watch.wall - (self.guard.own_seconds - guarding))
            return Verification(tracker.marks["forward"], process_peak or 0, process_peak, unguarded)
        series = tracker.series(grad_keys(self.root))
        tracker.release()
        run = RunTime(watch.wall, tracker.own_seconds, tracker.durations, watch.other_cpu)
        self.times.observe(run.durations)
        seconds = run.estimate(self.times, moves_data=any(moves_data(c) for c in [*choices, outside]))
        return Verification(series[tracker.marks["forward"] - 1], max(series), process_peak, seconds)


class _ProcessMarks:
    """Stands in for the tracker in a verification measured by the process: ``mark`` notes what the
    process holds above the step's start."""

    def __init__(self, guard: Guard) -> None:
        self.guard = guard
        self.marks: dict[str, int] = {}

    def __enter__(self) -> _ProcessMarks:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        pass

    def mark(self, name: str) -> None:
        self.marks[name] = self.guard.used()

    def release(self) -> None:
        pass


def detached_inputs(value: Any) -> Any:
    """``value`` with each tensor a new leaf sharing its storage (same ``requires_grad``): what
    planning runs on, so that its backwards end there."""
    leaves, rebuild = structures.flatten(value)
    return rebuild([leaf.detach().requires_grad_(leaf.requires_grad) if isinstance(leaf, torch.Tensor) else leaf
                    for leaf in leaves])


def _run_as(session: PlanningContext, site: Any, choice: str, *args: Any, **kwargs: Any) -> Any:
    return session.run_choice(site, choice, site.function, args, kwargs)


def _in_flight(site: Any) -> int:
    """An offloaded block's own copies in flight, however far they had got when it was measured."""
    return min(SharedOffload.IN_FLIGHT, 2 * site.saved)


def _bounds_of(choice: str, choices: list[str]) -> tuple[str, str] | None:
    """The two choices bounding a deferrable ``choice`` (``DEFERRED``), if both are among ``choices``."""
    base, sep, tier = choice.partition(":")
    names = DEFERRED.get(base)
    if names is None:
        return None
    bounds = tuple(f"{name}{sep}{tier}" if "offload" in name else name for name in names)
    return bounds if all(b in choices for b in bounds) else None  # type: ignore[return-value]


def _need(profile: BlockProfile) -> int:
    """The most a region's measured computing choices held at once (``INFEASIBLE`` if one went over)."""
    needs = [profile.held[c] + profile.transient[c] for c in profile.held if _memory_rank(c)[0] == 0]
    return max(needs, default=0)


def _memory_rank(choice: str) -> tuple[int, int]:
    base = choice.partition(":")[0]
    group = next(i for i, names in enumerate(ORDER) if base in names)
    return group, ORDER[group].index(base)


def _mark_when_reached(output: Any, tracker: LiveBytes, name: str) -> None:
    """Mark ``name`` on ``tracker`` when backward reaches ``output`` (the head's backward is over),
    noting the bytes of the gradient it reaches with in ``tracker.reached[name]``."""
    def reached(grad: torch.Tensor) -> None:
        if name not in tracker.marks:
            tracker.mark(name)
            tracker.reached[name] = grad.untyped_storage().nbytes()

    for leaf in structures.flatten(output)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            leaf.register_hook(reached)
            return


def _code_of(function: Callable[..., Any]) -> Any:
    while isinstance(function, functools.partial):
        function = function.func
    return getattr(function, "__code__", None) or getattr(getattr(function, "__func__", None), "__code__", None) \
        or type(function)
