"""Measure each block once per choice, without ever running the whole model unchecked.

1. One step with every block fully recomputed, under ``LiveBytes``: it captures each block's inputs
   and outputs (copies made outside the tracker).
   What lies outside the blocks (embeddings, head, loss inside the forward) is then measured alone:
   each block replays its recorded output (``replay``), one tracked step gives that part's held
   and transient bytes, untracked ones its time; again per offload tier with that part's saved
   tensors offloaded (``Profile.outside``). A fraction of a step each, where whole steps cost more.
2. Each block alone, per choice, on its captured input: bytes held when its forward ends, the
   transient above that during its recompute and backward, and its forward+backward time (fastest of
   ``repeats`` untracked runs). Blocks with the same class, parameter shapes and input shapes share
   one measurement. The block's input counts only if the block keeps it (it is a non-leaf there, as
   in the model) and the incoming gradient only from backward on: in the model, a block's output is
   the next block's input, counted once.
   ``offload`` is measured in context: two copies of the block through one shared schedule, its
   resident window sent out before forward ends as the next offloaded block would (and a second run
   keeping it, for the last offloaded block), so its held bytes, its transient with the previous
   block's tensors prefetched, its disk traffic and its time are those of a block among offloaded
   blocks, not of a block alone (which kept its last tensors resident and never wrote them).
The model's gradients, RNG state and forwards are restored afterwards.
"""

from __future__ import annotations

import functools
import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from .. import structures
from ..apply import _APPLIED
from ..blocks import find_blocks
from ..measure import default_loss
from ..region_state import region_inputs
from ..wrap import _MISSING
from .choices import SharedOffload, install, install_outside, is_offload, outside_choices
from .replay import Copies, recorded_keys, replay
from .tracker import LiveBytes, excluded_keys, grad_keys, storage_key

METHOD = ("measured block by block: one step with every block fully recomputed captured each block's input and "
          "output, the rest of the model ran alone (blocks replayed), kept and offloaded, then each block ran alone "
          "per choice (offload: two copies through one shared schedule)")


@dataclass
class BlockProfile:
    """Measurements of one block: per choice, bytes held after forward, transient bytes above that
    during its backward (recompute included), and forward+backward seconds. ``window``: for the
    ``offload`` choices, the bytes of the shared schedule's resident window (its last tensors, kept
    until backward when no offloaded block follows; prefetched ahead into the blocks before it)."""

    name: str
    held: dict[str, int]
    transient: dict[str, int]
    seconds: dict[str, float]
    shared_with: str | None = None
    window: dict[str, int] = field(default_factory=dict)


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
    method: str = METHOD
    recompute_step: dict[str, float] = field(default_factory=dict)
    outside: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per offload choice for what lies outside the blocks (``offload:disk``): its ``held``,
    ``transient`` and ``seconds`` with that part's saved tensors offloaded (``keep``: the
    ``other_*`` fields)."""

    def outside_choices(self) -> list[str]:
        """``keep`` and the profiled offload choices for the part outside the blocks."""
        return ["keep", *self.outside]

    def other(self, outside: str = "keep") -> tuple[int, int, float]:
        """``(held, transient, seconds)`` of the part outside the blocks run as ``outside``."""
        if outside == "keep":
            return self.other_held, self.other_transient, self.other_seconds
        if outside not in self.outside:
            raise ValueError(f"outside choice {outside!r} was not profiled; profiled: {self.outside_choices()}")
        entry = self.outside[outside]
        return int(entry["held"]), int(entry["transient"]), float(entry["seconds"])

    def window(self) -> int:
        """Bytes of the shared offload schedule's resident window (largest over blocks), 0 without
        an offload choice."""
        return max((size for b in self.blocks for c, size in b.window.items() if is_offload(c)), default=0)

    def peak_of(self, assignment: list[str], outside: str = "keep") -> int:
        """Predicted peak (see ``solver``): while block i runs, blocks before it hold their bytes;
        after the first offloaded block (from the start when the outside part is offloaded: the
        embeddings' tensors come first), the shared schedule's window is resident too (an offloaded
        block's own transient includes it: it was measured among offloaded blocks)."""
        other_held, other_transient, _ = self.other(outside)
        window, seen, first = self.window(), False, is_offload(outside)
        prefix, worst = 0, 0
        for block, choice in zip(self.blocks, assignment, strict=True):
            prefix += block.held[choice]
            extra = window if (seen or first) and not is_offload(choice) else 0
            worst = max(worst, prefix + block.transient[choice] + extra)
            seen = seen or is_offload(choice)
        return other_held + max(worst, prefix + other_transient + (window if seen else 0))

    def held_of(self, assignment: list[str], outside: str = "keep") -> int:
        return self.other(outside)[0] + sum(b.held[c] for b, c in zip(self.blocks, assignment, strict=True))

    def seconds_of(self, assignment: list[str], outside: str = "keep") -> float:
        return self.other(outside)[2] + sum(b.seconds[c] for b, c in zip(self.blocks, assignment, strict=True))

    def to_json(self) -> dict[str, Any]:
        return {"blocks": [vars(b) for b in self.blocks], "choices": self.choices, "other_held": self.other_held,
                "other_transient": self.other_transient, "other_seconds": self.other_seconds,
                "signature": self.signature, "prefetch": self.prefetch, "method": self.method,
                "recompute_step": self.recompute_step, "outside": self.outside}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Profile:
        data = dict(data)
        data["blocks"] = [BlockProfile(**b) for b in data["blocks"]]
        return cls(**data)


def split_inputs(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` from a tensor, a tuple/list of positional inputs or a dict of keywords."""
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def model_signature(model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> str:
    """A digest of the model's blocks and parameter names and shapes (plans are tied to it)."""
    digest = hashlib.sha256()
    for name, block in blocks:
        digest.update(f"{name}:{type(block).__qualname__};".encode())
    for name, param in model.named_parameters():
        digest.update(f"{name}:{tuple(param.shape)}:{param.dtype};".encode())
    return digest.hexdigest()[:16]


class ModelState:
    """Snapshot of what profiling touches: block forwards, parameter gradients, RNG states."""

    def __init__(self, model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> None:
        self.model = model
        self.modules = [block for _, block in blocks] + [model]  # the model: the outside choice's scope
        self.forwards = [(module.__dict__.get("forward"), module.__dict__.get(_APPLIED)) for module in self.modules]
        self.grads = [(p, p.grad) for p in model.parameters()]
        self.rng = torch.get_rng_state()
        self.training = model.training

    def restore(self) -> None:
        for block, (forward, applied) in zip(self.modules, self.forwards, strict=True):
            for key, value in (("forward", forward), (_APPLIED, applied)):
                if value is None:
                    block.__dict__.pop(key, None)
                else:
                    block.__dict__[key] = value
        for param, grad in self.grads:
            param.grad = grad
        torch.set_rng_state(self.rng)
        self.model.train(self.training)



def _grad_flags(value: Any) -> list[bool]:
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
    (parameter gradients and the inputs excluded). Gradients accumulate as in a real step."""
    tracker = LiveBytes(excluded_keys(model, split_inputs(inputs)))
    with tracker:
        run_step(model, inputs, loss_fn, tracker)
        tracker.mark("end")
    series = tracker.series(grad_keys(model))
    tracker.release()
    return series[tracker.marks["forward"] - 1] if tracker.marks["forward"] else 0, max(series, default=0)


def _block_step(block: Callable[..., Any], args: Any, kwargs: Any, flags: list[bool], tracker: LiveBytes | None,
                copies: int = 1, before_mark: Callable[[], None] | None = None,
                frozen: Sequence[nn.Parameter] = ()) -> None:
    """One forward and backward of ``copies`` independent calls of ``block`` on fresh copies of its
    inputs. The inputs that need grad are non-leaf (counted only if the block keeps them, as in the
    model); the cotangents are not counted (the incoming gradient is, from backward on).
    ``before_mark`` runs when forward ends, before it is marked. ``frozen``: parameters that get no
    gradient from all copies but the last (in the model each block has its own: a second copy's
    parameter gradients, summed into the first's, are no transient of the model's)."""
    leaves, rebuild = structures.flatten((args, kwargs))
    outs = []
    for copy in range(copies):
        freeze = [p for p in frozen if p.requires_grad] if copy < copies - 1 else []
        for param in freeze:
            param.requires_grad_(False)
        with _disable_current_modes():
            fresh = [leaf.detach().clone().requires_grad_(flag) if isinstance(leaf, torch.Tensor) else leaf
                     for leaf, flag in zip(leaves, flags, strict=True)]
        if tracker is not None:
            tracker.excluded |= {key[0] for leaf in fresh if isinstance(leaf, torch.Tensor)
                                 and (key := storage_key(leaf))}
        inputs = [leaf.clone() if isinstance(leaf, torch.Tensor) and leaf.requires_grad else leaf for leaf in fresh]
        call_args, call_kwargs = rebuild(inputs)
        del fresh, inputs
        try:
            output = block(*call_args, **call_kwargs)
        finally:
            for param in freeze:
                param.requires_grad_(True)
        del call_args, call_kwargs
        outs += [leaf for leaf in structures.flatten(output)[0]
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


def measure_choice(call: Callable[..., Any], args: Any, kwargs: Any, flags: list[bool], excluded: set[int],
                   grads: Callable[[], set[int]], reset: Callable[[], None], offload: SharedOffload | None,
                   repeats: int, params: Sequence[nn.Parameter] = ()) -> tuple[int, int, float, int]:
    """``(held, transient, seconds, window)`` of one block run as a choice (``call``); ``offload``:
    the shared schedule ``call`` offloads through, for the ``offload`` choices (measured in
    context, see the module docstring); ``params``: the block's parameters."""

    def tracked(copies: int, flush: Callable[[], None] | None) -> tuple[int, int]:
        reset()
        tracker = LiveBytes(set(excluded))
        with tracker:
            _block_step(call, args, kwargs, flags, tracker, copies, flush, params)
            tracker.mark("end")
        series = tracker.series(grads())
        tracker.release()
        return series[tracker.marks["forward"] - 1], max(series)

    # Timed first: the untracked runs also warm up (a disk tier's files, lazy initialisation).
    if offload is None:
        seconds = _timed(functools.partial(_block_step, call, args, kwargs, flags, None), repeats)
        held, peak = tracked(1, None)
        reset()
        return held, peak - held, seconds, 0
    seconds = _timed(functools.partial(_block_step, call, args, kwargs, flags, None, 2, offload.flush), repeats) / 2
    held_kept, peak_kept = tracked(2, None)  # the last offloaded block: its window stays resident
    held_sent, peak_sent = tracked(2, offload.flush)  # a block followed by offloaded blocks
    reset()
    return -(-held_sent // 2), max(peak_kept, peak_sent) - held_sent, seconds, max(0, held_kept - held_sent)


def _block_key(block: nn.Module, args: Any, kwargs: Any) -> tuple[Any, ...]:
    leaves, _ = structures.flatten((args, kwargs))
    shapes = tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else repr(t)[:64] for t in leaves)
    params = tuple((n, tuple(p.shape)) for n, p in block.named_parameters())
    return type(block), params, shapes


def profile_model(model: nn.Module, inputs: Any, *, loss_fn: Callable[[Any], torch.Tensor] | None,
                  choices: list[str], prefetch: int, repeats: int = 2,
                  blocks: list[tuple[str, nn.Module]] | None = None) -> Profile:
    """Measure ``model``'s blocks per choice (see the module docstring)."""
    blocks = blocks if blocks is not None else find_blocks(model)
    if not blocks:
        raise ValueError(f"acshim.plan: found no repeated blocks in {type(model).__name__} to plan for")
    state = ModelState(model, blocks)
    model.train()
    try:
        install_outside(model, "keep")  # a plan applied before offloads the outside part: not while profiling
        return _profile(model, inputs, loss_fn, choices, prefetch, repeats, blocks)
    finally:
        state.restore()


def _profile(model: nn.Module, inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None, choices: list[str],
             prefetch: int, repeats: int, blocks: list[tuple[str, nn.Module]]) -> Profile:
    captured: dict[str, tuple[Any, Any, list[bool]]] = {}
    outputs: dict[str, Any] = {}
    copies = Copies()
    tracker = LiveBytes(excluded_keys(model, split_inputs(inputs)))
    handles = []

    def capture(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            if name not in captured and torch.is_grad_enabled():
                # what a region of this block receives: a Hugging Face cache dropped (a block run
                # again on a captured cache would extend it and backpropagate into a freed graph)
                args, kwargs = region_inputs(module.forward, tuple(args), dict(kwargs))
                captured[name] = (*copies((args, kwargs)), _grad_flags((args, kwargs)))
        return hook

    def record(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if name not in outputs and torch.is_grad_enabled():
                outputs[name] = copies(output)
        return hook

    for name, block in blocks:
        install(block, "recompute")
        handles.append(block.register_forward_pre_hook(capture(name), with_kwargs=True))
        handles.append(block.register_forward_hook(record(name)))
    try:
        held_full, peak_full, whole_peak = _model_step_bytes(model, inputs, loss_fn, blocks, tracker)
    finally:
        for handle in handles:
            handle.remove()
    model.zero_grad(set_to_none=True)
    # What lies outside the blocks, alone (blocks replayed): kept, and offloaded per tier
    outside: dict[str, dict[str, float]] = {}
    for choice in outside_choices(model, choices):
        held, peak, seconds = _outside_alone(model, inputs, loss_fn, blocks, outputs, choice, prefetch, repeats)
        outside[choice] = {"held": held, "transient": max(0, peak - held), "seconds": seconds}
    kept = outside.pop("keep")
    _err_high(kept, outside, whole_peak - held_full)

    profiles: list[BlockProfile] = []
    measured: dict[tuple[Any, ...], BlockProfile] = {}
    for name, block in blocks:
        if name not in captured:
            raise ValueError(f"acshim.plan: block {name} did not run in the model's forward")
        args, kwargs, flags = captured[name]
        key = _block_key(block, args, kwargs)
        if key in measured:
            first = measured[key]
            profiles.append(BlockProfile(name, dict(first.held), dict(first.transient), dict(first.seconds), first.name,
                                         dict(first.window)))
            continue
        held, transient, seconds, window = {}, {}, {}, {}
        excluded = excluded_keys(block, (args, kwargs))
        for choice in choices:
            shared: dict[str, SharedOffload] = {}
            install(block, choice, prefetch, shared)
            held[choice], transient[choice], seconds[choice], window[choice] = measure_choice(
                block, args, kwargs, flags, excluded, functools.partial(grad_keys, block),
                functools.partial(block.zero_grad, set_to_none=True),
                next(iter(shared.values())) if is_offload(choice) else None, repeats, list(block.parameters()))
        install(block, "recompute")
        measured[key] = BlockProfile(name, held, transient, seconds, window=window)
        profiles.append(measured[key])
    seconds = kept["seconds"] + sum(p.seconds["recompute"] for p in profiles)
    return Profile(blocks=profiles, choices=list(choices), other_held=int(kept["held"]),
                   other_transient=int(kept["transient"]), other_seconds=kept["seconds"],
                   signature=model_signature(model, blocks), prefetch=prefetch,
                   recompute_step={"held": held_full, "peak": peak_full, "seconds": seconds}, outside=outside)


def _model_step_bytes(model: nn.Module, inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None,
                      blocks: list[tuple[str, nn.Module]], tracker: LiveBytes) -> tuple[int, int, int]:
    """One step under ``tracker``: ``(held after forward, peak, peak outside the blocks)``, the last
    over forward and the head's backward (up to the gradient reaching the last block)."""

    def head_done(module: nn.Module, args: Any, output: Any) -> None:
        if "forward" in tracker.marks or not torch.is_grad_enabled():
            return
        for leaf in structures.flatten(output)[0]:
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(lambda grad: tracker.mark("head") if "head" not in tracker.marks else None)
                break

    handle = blocks[-1][1].register_forward_hook(head_done)
    model.zero_grad(set_to_none=True)
    try:
        with tracker:
            run_step(model, inputs, loss_fn, tracker)
            tracker.mark("end")
    finally:
        handle.remove()
    series = tracker.series(grad_keys(model))
    tracker.release()
    held = series[tracker.marks["forward"] - 1]
    head_end = tracker.marks.get("head", len(series))
    return held, max(series), max(series[:max(head_end, tracker.marks["forward"])])


def _outside_alone(model: nn.Module, inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None,
                   blocks: list[tuple[str, nn.Module]], outputs: dict[str, Any], outside: str, prefetch: int,
                   repeats: int) -> tuple[int, int, float]:
    """``(held after forward, peak up to the head's backward, seconds)`` of the part of the model
    outside the blocks run as ``outside``, each block replaced by its recorded output
    (``replay``); the blocks' and the model's forwards are put back afterwards."""
    forwards = [block.__dict__.get("forward", _MISSING) for _, block in blocks]
    for name, block in blocks:
        block.forward = functools.partial(_replayed, outputs[name])
    try:
        install_outside(model, outside, prefetch, {})
        model.zero_grad(set_to_none=True)
        tracker = LiveBytes(excluded_keys(model, split_inputs(inputs)) | recorded_keys(outputs))
        held, _, peak = _model_step_bytes(model, inputs, loss_fn, blocks, tracker)  # warms a tier up too
        model.zero_grad(set_to_none=True)
        seconds = _timed(lambda: run_step(model, inputs, loss_fn), repeats)
    finally:
        install_outside(model, "keep")
        for (_, block), forward in zip(blocks, forwards, strict=True):
            if forward is _MISSING:
                block.__dict__.pop("forward", None)
            else:
                block.forward = forward
        model.zero_grad(set_to_none=True)
    return held, peak, seconds


def _err_high(kept: dict[str, float], offloaded: dict[str, dict[str, float]], whole_transient: int) -> None:
    """Raise the outside part's transients (in place) by what the profiling step of the whole model
    saw above the replayed one (the blocks' own forward transients, which the replay leaves out):
    the prediction errs towards more memory, equally for each outside choice."""
    extra = max(0, whole_transient - int(kept["transient"]))
    for entry in (kept, *offloaded.values()):
        entry["transient"] = int(entry["transient"]) + extra


def _replayed(recorded: Any, *args: Any, **kwargs: Any) -> Any:
    return replay(recorded, args, kwargs)



def _timed(function: Callable[[], None], repeats: int) -> float:
    best = float("inf")
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - start)
    return best
