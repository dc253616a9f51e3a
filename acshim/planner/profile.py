"""What the planner measured: per block and choice, memory and time (``Profile``), and how one block
is run alone to measure it (``measure_choice``).

How a model is profiled (``profiler.RegionProfiler``), in short: one forward counts what each block
and the part outside them would save without holding any of it; the outside part then runs alone
with the blocks replaying outputs of the right shape (kept, and offloaded per tier); each distinct
block runs alone once per choice, cheapest in memory first, on a copy of its input. Every
measurement runs under a guard that stops it when the process goes over the budget (the choice is
then ``INFEASIBLE``: no plan using it fits), and is timed operator by operator (``costs``).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from .. import structures
from ..apply import APPLIED_ATTRIBUTE
from ..measure import default_loss
from .choices import ASKED, SharedOffload, is_offload
from .costs import RunTime, Stopwatch
from .tracker import LiveBytes, excluded_keys, grad_keys, storage_key

INFEASIBLE = 1 << 62
"""Held bytes of a choice that could not be measured within the budget (its measurement alone went
over it, so no plan using it fits). Large, so a maximum over ranks keeps it."""


@dataclass
class BlockProfile:
    """Measurements of one block: per choice, bytes held after forward, transient bytes above that
    during its backward (recompute included), and forward+backward seconds. ``window``: for the
    ``offload`` choices, the bytes of the shared schedule's resident window (its last tensors, kept
    until backward when no offloaded block follows; prefetched ahead into the blocks before it).
    ``saved``: bytes its forward saves for backward without checkpointing (counted, never held)."""

    name: str
    held: dict[str, int]
    transient: dict[str, int]
    seconds: dict[str, float]
    shared_with: str | None = None
    window: dict[str, int] = field(default_factory=dict)
    saved: int = 0
    forward: dict[str, int] = field(default_factory=dict)
    """For the choices that move data: the forward's own peak above ``held`` (``ChoiceMeasurement.forward``),
    which the plan's copies in flight beyond the profiles' own add to (``Profile.peak_of``'s ``extra``);
    where missing, they are added to the whole transient."""


def feasible(block: BlockProfile, choice: str) -> bool:
    """True if ``choice`` was measured within the budget for ``block``."""
    return block.held.get(choice, INFEASIBLE) < INFEASIBLE


@dataclass
class Profile:
    """Everything the solver needs, and how it was measured."""

    blocks: list[BlockProfile]
    choices: list[str]
    other_held: int
    other_transient: int
    other_seconds: float
    signature: str
    prefetch: int
    method: str = ""
    recompute_step: dict[str, float] = field(default_factory=dict)
    outside: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per offload choice for what lies outside the blocks (``offload:disk``): its ``held``,
    ``transient`` and ``seconds`` with that part's saved tensors offloaded (``keep``: the
    ``other_*`` fields)."""
    other_saved: int = 0
    """Bytes the part outside the blocks saves for backward (counted, never held)."""
    inputs: list[list[int]] = field(default_factory=list)
    """Shapes of the step's input tensors the profile was measured on."""
    stops: dict[str, int] = field(default_factory=dict)
    """Parts whose measurement the budget stopped, with what the process held then."""
    unchecked_floor: int = 0
    """A lower bound of no checkpointing's peak from the step run on fake tensors (0: none): what
    ``plan.reference`` never goes below where the budget stopped the measurements it adds up."""
    unmeasured: list[str] = field(default_factory=list)
    """Choices left unmeasured because no plan within reach of the budget would take them (the
    planner's ``DEFERRED``): ``INFEASIBLE`` here, so ``frontier()`` below this budget leaves them out."""
    other_back: int | None = None
    """What the part outside the blocks (run as ``keep``) still holds while the blocks run: its bytes
    once the head's and the loss's backward is over (the embeddings' saved tensors; the gradient it
    passes to the blocks is left out, as each block's measurement counts its incoming gradient), at
    most ``other_held``; None where it was not measured (a sharded model's profile, an
    older plan file): ``other_held`` then. The head's saved tensors are freed before any block's
    backward and made after every block's forward, so a block's peak does not meet them: counting
    them there predicted HF GPT-2 8x512's all-disk plan at 37.1 MiB of activations where its steps
    held 32.1-33.0 MiB. Offloaded outside choices keep theirs in ``outside[choice]["back"]``."""
    copies_outlive_blocks: bool = True
    """Whether an offloaded block's copies out may still be in flight once its forward has returned
    (``choices.copies_outlive_blocks``: the CUDA host tier's). Where they may not (every tier on CPU,
    the disk tier on CUDA: the block's scope waits for them), the copies a plan lets be in flight
    beyond the profiles' own (``Plan.in_flight``) are counted only in the offloaded blocks' own
    forward, not in the blocks after them nor in the head's backward (``peak_of``'s ``extra``); an
    offloaded outside part puts every block inside its scope, so its copies may outlive any block.
    True, the cautious answer, where it was not recorded (a sharded model's profile, an older plan
    file)."""

    def outside_choices(self) -> list[str]:
        """The choices for the part outside the blocks that were measured within the budget."""
        return [c for c in ["keep", *self.outside] if self.other(c)[0] < INFEASIBLE]

    def other(self, outside: str = "keep") -> tuple[int, int, float]:
        """``(held, transient, seconds)`` of the part outside the blocks run as ``outside``."""
        if outside == "keep":
            return self.other_held, self.other_transient, self.other_seconds
        if outside not in self.outside:
            raise ValueError(f"outside choice {outside!r} was not profiled; profiled: {['keep', *self.outside]}")
        entry = self.outside[outside]
        return int(entry["held"]), int(entry["transient"]), float(entry["seconds"])

    def back(self, outside: str = "keep") -> int:
        """What the part outside the blocks run as ``outside`` holds while the blocks run
        (``other_back``; its held bytes where that was not measured)."""
        held = self.other(outside)[0]
        found = self.other_back if outside == "keep" else self.outside.get(outside, {}).get("back")
        return held if found is None else min(held, int(found))

    def window(self) -> int:
        """Bytes the shared offload schedule holds besides the blocks' own, from the first offloaded
        block on: its resident window (largest over blocks) and the copies it lets be in flight
        (``SharedOffload.IN_FLIGHT``); 0 without an offload choice. The solver keeps those copies in
        every prediction after the first offloaded block, though on CPU a block's scope waits for its
        own (``copies_outlive_blocks``): without them, HF GPT-2 8x384 at ``--budget 0.3`` was planned
        as 5 offload:disk, 2 selective-alt, keep in one process and 6 offload:disk, selective, keep
        in the next (0.2% of a step apart in predicted time, 8 MiB apart in peak, at the budget's
        edge); with them, that pair of processes both took the second (a busy core can still flip a
        plan there between recompute and offload: offloading's time estimate)."""
        windows = [size for b in self.blocks for c, size in b.window.items() if is_offload(c) and feasible(b, c)]
        return max(windows) + self.in_flight() if windows else 0

    def lingering(self, outside: str = "keep") -> bool:
        """Whether copies out may be in flight outside the offloaded block that made them, with the
        part outside the blocks run as ``outside`` (``copies_outlive_blocks``)."""
        return self.copies_outlive_blocks or is_offload(outside)

    def in_flight(self) -> int:
        """Bytes an offloading plan may have in flight: the tier's back-pressure bound, or what two
        blocks save, if less (copies cannot be larger than what was saved)."""
        largest = max((max(b.saved, b.held.get("keep", 0) if feasible(b, "keep") else 0) for b in self.blocks),
                      default=0)
        return min(SharedOffload.IN_FLIGHT, 2 * largest) if largest else SharedOffload.IN_FLIGHT

    def peak_of(self, assignment: list[str], outside: str = "keep", extra: int = 0) -> int:
        """Predicted peak (see ``solver``): while block i runs, blocks before it hold their bytes and
        the part outside the blocks what it holds then (``back``: not the head's saved tensors);
        after the first offloaded block (from the start when the outside part is offloaded: the
        embeddings' tensors come first), the shared schedule's window is resident too (an offloaded
        block's own transient includes it: it was measured among offloaded blocks). ``extra``: bytes
        of copies in flight beyond the profiles' own (``Plan.in_flight``), added where copies can be
        in flight: an offloaded block's forward, or everywhere after the first offloaded block where
        copies may outlive their block (``lingering``)."""
        other_held, other_transient, _ = self.other(outside)
        window, seen, first = self.window(), False, is_offload(outside)
        lingering = self.lingering(outside)
        prefix, worst = 0, 0
        for block, choice in zip(self.blocks, assignment, strict=True):
            prefix += block.held[choice]
            if is_offload(choice):
                own = block.transient[choice] + extra if lingering else _with_more_in_flight(block, choice, extra)
                worst = max(worst, prefix + own)
            else:
                beside = window + (extra if lingering else 0) if seen or first else 0
                worst = max(worst, prefix + block.transient[choice] + beside)
            seen = seen or is_offload(choice)
        after = window + (extra if lingering else 0) if seen else 0
        return min(INFEASIBLE, max(self.back(outside) + worst, other_held + prefix + other_transient + after))

    def offloads(self, assignment: list[str], outside: str = "keep") -> bool:
        """Whether ``assignment`` / ``outside`` offloads anything (copies in flight only then)."""
        return any(is_offload(c) for c in [*assignment, outside])

    def uniform(self, choice: str) -> list[str]:
        """Every block as ``choice``, but those that run as the script asked (``choices.ASKED``: their
        only choice): what "every region the same" means for this model."""
        return [ASKED if feasible(block, ASKED) else choice for block in self.blocks]

    def held_of(self, assignment: list[str], outside: str = "keep") -> int:
        held = self.other(outside)[0] + sum(b.held[c] for b, c in zip(self.blocks, assignment, strict=True))
        return min(INFEASIBLE, held)

    def seconds_of(self, assignment: list[str], outside: str = "keep") -> float:
        return self.other(outside)[2] + sum(b.seconds[c] for b, c in zip(self.blocks, assignment, strict=True))

    def to_json(self) -> dict[str, Any]:
        return {"blocks": [vars(b) for b in self.blocks], "choices": self.choices, "other_held": self.other_held,
                "other_transient": self.other_transient, "other_seconds": self.other_seconds,
                "signature": self.signature, "prefetch": self.prefetch, "method": self.method,
                "recompute_step": self.recompute_step, "outside": self.outside, "other_saved": self.other_saved,
                "inputs": self.inputs, "stops": self.stops, "unmeasured": self.unmeasured,
                "copies_outlive_blocks": self.copies_outlive_blocks, "other_back": self.other_back}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Profile:
        data = dict(data)
        data["blocks"] = [BlockProfile(**b) for b in data["blocks"]]
        return cls(**data)


def _with_more_in_flight(block: BlockProfile, choice: str, extra: int) -> int:
    """An offloaded ``block``'s transient as ``choice`` with ``extra`` more bytes of copies in flight
    than it was measured with (``with_copies_in_flight``): they add to its forward's peak, which its
    backward does not meet; to the whole transient where its forward was not recorded."""
    if extra <= 0:
        return block.transient[choice]
    if choice not in block.forward:
        return block.transient[choice] + extra
    own = min(SharedOffload.IN_FLIGHT, 2 * block.saved)  # what it was measured with (profiler._in_flight)
    return max(block.transient[choice], block.forward[choice] + own + extra)


def split_inputs(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` from a tensor, a tuple/list of positional inputs or a dict of keywords."""
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def input_shapes(args: Any, kwargs: Any) -> list[list[int]]:
    """Shapes of the tensors among a call's arguments, in order."""
    return [list(leaf.shape) for leaf in structures.flatten((args, kwargs))[0] if isinstance(leaf, torch.Tensor)]


def larger_inputs(shapes: list[list[int]], planned: list[list[int]]) -> bool:
    """True when some input is larger than the planned one in the same position (or a new one)."""
    if not planned:
        return False
    if len(shapes) != len(planned):
        return sum(map(math.prod, shapes)) > sum(map(math.prod, planned))
    return any(len(a) != len(b) or any(x > y for x, y in zip(a, b, strict=True)) for a, b in zip(shapes, planned,
                                                                                                  strict=True))


def largest_inputs(planned: list[list[int]], shapes: list[list[int]]) -> list[list[int]]:
    """The inputs planned for once ``shapes`` are too: each size the larger of the two where they
    line up, else ``shapes``."""
    if not planned or len(planned) != len(shapes) or any(len(a) != len(b) for a, b in zip(planned, shapes, strict=True)):
        return shapes
    return [[max(x, y) for x, y in zip(a, b, strict=True)] for a, b in zip(planned, shapes, strict=True)]


def model_signature(model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> str:
    """A digest of the model's blocks and parameter names and shapes (plans are tied to it)."""
    digest = hashlib.sha256()
    for name, block in blocks:
        digest.update(f"{name}:{type(block).__qualname__};".encode())
    for name, param in model.named_parameters():
        digest.update(f"{name}:{tuple(param.shape)}:{param.dtype};".encode())
    return digest.hexdigest()[:16]


class ModelState:
    """Snapshot of what planning touches: block forwards, parameter gradients, RNG states."""

    def __init__(self, model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> None:
        self.model = model
        self.modules = [block for _, block in blocks] + [model]  # the model: the outside choice's scope
        self.forwards = [(module.__dict__.get("forward"), module.__dict__.get(APPLIED_ATTRIBUTE)) for module in self.modules]
        self.grads = [(p, p.grad) for p in model.parameters()]
        self.rng = torch.get_rng_state()
        self.training = model.training

    def restore(self) -> None:
        for block, (forward, applied) in zip(self.modules, self.forwards, strict=True):
            for key, value in (("forward", forward), (APPLIED_ATTRIBUTE, applied)):
                if value is None:
                    block.__dict__.pop(key, None)
                else:
                    block.__dict__[key] = value
        for param, grad in self.grads:
            param.grad = grad
        torch.set_rng_state(self.rng)
        self.model.train(self.training)


def grad_flags(value: Any) -> list[bool]:
    leaves, _ = structures.flatten(value)
    return [isinstance(leaf, torch.Tensor) and leaf.requires_grad for leaf in leaves]


def run_step(model: nn.Module, inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None,
             tracker: LiveBytes | None = None) -> None:
    """One forward and backward; with ``tracker``, marks ``forward`` when forward ends."""
    args, kwargs = split_inputs(inputs)
    output = model(*args, **kwargs)
    loss = (loss_fn or default_loss)(output)
    del output
    if tracker is not None:
        tracker.mark("forward")
    loss.backward()
    del loss


def measure_step(model: nn.Module, inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None = None
                 ) -> tuple[int, int]:
    """``(held after forward, peak)`` activation bytes of one training step of ``model`` as it is
    (parameter gradients and the inputs excluded), counted by the storage tracker. Gradients
    accumulate as in a real step."""
    tracker = LiveBytes(excluded_keys(model, split_inputs(inputs)))
    with tracker:
        run_step(model, inputs, loss_fn, tracker)
        tracker.mark("end")
    series = tracker.series(grad_keys(model))
    tracker.release()
    return series[tracker.marks["forward"] - 1] if tracker.marks["forward"] else 0, max(series, default=0)


def block_step(block: Callable[..., Any], args: Any, kwargs: Any, flags: list[bool], tracker: LiveBytes | None,
               before_mark: Callable[[], None] | None = None) -> None:
    """One forward and backward of ``block`` on fresh copies of its inputs. The inputs that need
    grad are non-leaf (counted only if the block keeps them, as in the model); the cotangents are
    not counted (the incoming gradient is, from backward on). ``before_mark`` runs when forward
    ends, before it is marked."""
    leaves, rebuild = structures.flatten((args, kwargs))
    with _disable_current_modes():
        fresh = [leaf.detach().clone().requires_grad_(flag) if isinstance(leaf, torch.Tensor) else leaf
                 for leaf, flag in zip(leaves, flags, strict=True)]
    if tracker is not None:
        tracker.excluded |= {key[0] for leaf in fresh if isinstance(leaf, torch.Tensor) and (key := storage_key(leaf))}
    inputs = [leaf.clone() if isinstance(leaf, torch.Tensor) and leaf.requires_grad else leaf for leaf in fresh]
    call_args, call_kwargs = rebuild(inputs)
    del fresh, inputs
    output = block(*call_args, **call_kwargs)
    del call_args, call_kwargs
    outs = [leaf for leaf in structures.flatten(output)[0]
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad and leaf.is_floating_point()]
    del output
    with _disable_current_modes():
        generator = torch.Generator().manual_seed(0)
        cotangents = [torch.randn(o.shape, generator=generator, dtype=o.dtype).to(o.device) for o in outs]
    if tracker is not None:
        tracker.excluded |= {key[0] for c in cotangents if (key := storage_key(c))}
    loss = sum((o * c).sum() for o, c in zip(outs, cotangents, strict=True))
    del outs
    if before_mark is not None:
        before_mark()
    if tracker is not None:
        tracker.mark("forward")
    if isinstance(loss, torch.Tensor):
        loss.backward()
    del loss


@dataclass
class ChoiceMeasurement:
    """One block run as one choice: bytes held after forward, transient above that, the offload
    schedule's resident window, and the timed run (``RunTime``: seconds are estimated once every
    choice has been measured, see ``costs``)."""

    held: int
    transient: int
    window: int
    run: RunTime
    forward: int = 0
    """The forward's own peak above ``held`` (0 if it never rose above): what copies still in flight
    add to (``RegionProfiler._measure``), as they cannot in backward, whose reads wait for them."""


def with_copies_in_flight(found: ChoiceMeasurement, in_flight: int) -> int:
    """``found``'s transient with ``in_flight`` bytes of its copies out still held: copies hold their
    tensors wherever they had got to when the peak came, which in forward may be up to the tier's
    bound. Backward's peak meets none: a block's reads wait for its own copies, and earlier copies
    finish first (one queue). (Adding them to the whole peak, which comes in backward, predicted the
    all-disk plan of HF GPT-2 8x384 at 47.3 MiB where its step measured 36.1.)"""
    return max(found.transient, found.forward + in_flight)


def measure_choice(call: Callable[..., Any], args: Any, kwargs: Any, flags: list[bool], excluded: set[int],
                   grads: Callable[[], set[int]], reset: Callable[[], None], offload: SharedOffload | None
                   ) -> ChoiceMeasurement:
    """One block run alone as one choice (``call``), tracked and timed. ``offload``: the shared
    schedule ``call`` offloads through: then, when forward ends, the bytes held with the schedule's
    resident window still there are noted (what the last offloaded block leaves resident: the
    window) and the window is sent out before backward, as the next offloaded block's saves would:
    held bytes, transient with the window prefetched back, time, copies to the tier and back, from one
    run. The block's transient with the previous block's window being prefetched is its own plus
    that window."""
    reset()
    tracker = LiveBytes(set(excluded), timed=True)

    def send_window() -> None:
        assert offload is not None
        tracker.mark("kept")
        offload.flush()

    with tracker:
        with Stopwatch() as watch:
            block_step(call, args, kwargs, flags, tracker, send_window if offload is not None else None)
            if offload is not None:
                offload.session.raise_write_errors(wait=True)  # its copies' time is part of it
        tracker.mark("end")
    series = tracker.series(grads())
    tracker.release()
    reset()
    held, peak = series[tracker.marks["forward"] - 1], max(series)
    forward = max(0, max(series[:tracker.marks["forward"]]) - held)
    waits = offload.session.stats.wait_seconds if offload is not None else 0.0
    run = RunTime(watch.wall, tracker.own_seconds, tracker.durations, watch.other_cpu, waits)
    if offload is None:
        return ChoiceMeasurement(held, peak - held, 0, run, forward)
    window = max(0, series[tracker.marks["kept"] - 1] - held) if tracker.marks["kept"] else 0
    return ChoiceMeasurement(held, max(peak - held, window), window, run, forward)


def block_key(owner: nn.Module, args: Any, kwargs: Any) -> tuple[Any, ...]:
    """Blocks with the same class, parameter shapes and input shapes share one measurement."""
    leaves, _ = structures.flatten((args, kwargs))
    shapes = tuple((tuple(t.shape), t.dtype, t.requires_grad) if isinstance(t, torch.Tensor) else repr(t)[:64]
                   for t in leaves)
    params = tuple((n, tuple(p.shape), p.requires_grad) for n, p in owner.named_parameters())
    return type(owner), params, shapes


def elapsed(function: Callable[[], None]) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def parameters_of(modules: Sequence[nn.Module]) -> list[nn.Parameter]:
    return [p for module in modules for p in module.parameters()]
