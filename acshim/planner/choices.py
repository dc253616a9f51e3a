"""The per-block choices the planner decides between, and how each one is installed on a block.

Every choice except ``keep`` installs a ``CheckpointedForward`` (or a subclass) as the block's
instance ``forward`` and marks it as ``apply_checkpointing``'s, so ``acshim.remove_checkpointing``
undoes a plan like any other policy.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from ..apply import APPLIED_ATTRIBUTE
from ..backends import backend_for
from ..options import RegionOptions
from ..selective import DEFAULT_SAVE_OPS, save_ops
from ..wrap import (
    MISSING,
    CheckpointedForward,
    checkpoint_module,
    checkpointed_forward_of,
    uncheckpoint_module,
)

BASE_CHOICES = ("keep", "selective", "selective-alt", "recompute", "offload", "recompute+offload")
"""``keep``: no checkpointing. ``selective``: recompute all but matmul/attention outputs.
``selective-alt``: as ``selective`` but only every other matmul is saved. ``recompute``: full
recompute from the block's input. ``offload``: no recompute, every saved tensor of the block goes to
the storage tier (prefetched back); the offloaded blocks of one model share one schedule, as one
``acshim.offload()`` around the whole step would. ``recompute+offload``: full recompute, the
block's input goes to the storage tier."""

ASKED = "as-asked"
"""Not a choice the planner offers: a region whose script's own selective-checkpoint policy offloads
(``CheckpointPolicy.MUST_CPU_OFFLOAD`` / ``PREFER_CPU_OFFLOAD``, found by ``selective.OffloadProbe``)
runs with the script's own options, its offload decisions to the storage tier, on every step; it is
measured that way and is the only choice such a region has (no other is measured for it)."""

DESCRIPTIONS = {
    "keep": "no checkpointing",
    "selective": "recompute, save matmul/attention outputs",
    "selective-alt": "recompute, save every other matmul",
    "recompute": "full recompute",
    "offload": "offload saved tensors",
    "recompute+offload": "full recompute, input offloaded",
    ASKED: "as the script asked (its offload policy)",
}


def expand_choices(choices: tuple[str, ...] | list[str], tiers: tuple[str, ...]) -> list[str]:
    """Concrete choice names: offload choices get one entry per tier (``offload:disk``)."""
    out: list[str] = []
    for choice in choices:
        base = choice.split(":")[0]
        if base not in BASE_CHOICES:
            raise ValueError(f"unknown planner choice {choice!r}; known: {', '.join(BASE_CHOICES)}")
        if base.endswith("offload"):
            out += [choice] if ":" in choice else [f"{base}:{tier}" for tier in tiers]
        else:
            out.append(base)
    return list(dict.fromkeys(out))


class SharedOffload:
    """One offload schedule shared by every ``offload`` block of a model: each saved tensor is one
    group of a single session, so only the step's last ``prefetch`` tensors stay resident when
    forward ends and backward prefetches across block boundaries, exactly as one
    ``acshim.offload(storage, prefetch)`` around the whole forward. One block's offload scope alone
    (a session per block) kept the last ``prefetch`` tensors of *every* block resident instead."""

    IN_FLIGHT = 4 << 20
    """Bytes waiting to be copied out before forward waits for the oldest copy (the storage tier's
    back-pressure, at most its own bound): profiles and predicted peaks count them, as copies in
    flight hold their tensors wherever the copies have got to when the peak comes."""
    MAX_IN_FLIGHT = 8 << 20
    """The most a plan lets be in flight (the disk tier's own bound): a plan whose predicted peak
    leaves room under its budget lets up to this much be in flight (``Plan.in_flight``), as
    ``acshim.offload`` around the step does, so forward waits less for the copies."""

    def __init__(self, storage: str, prefetch: int, in_flight: int = IN_FLIGHT) -> None:
        from ..storage.scopes import OffloadOptions

        self.storage, self.prefetch, self.in_flight = storage, prefetch, in_flight
        options = OffloadOptions(storage, prefetch, None, None, None, None, None)
        self.session = options.session(options.tier(), per_tensor_groups=True)
        self.session.max_bytes_in_flight = min(self.session.max_bytes_in_flight, in_flight)
        self._hooks: list[Any] = []

    def __enter__(self) -> SharedOffload:
        from torch.autograd.graph import saved_tensors_hooks

        hooks = saved_tensors_hooks(self.session.pack, self.session.unpack)
        hooks.__enter__()
        self._hooks.append(hooks)
        return self

    def __exit__(self, exc_type: Any, exc: Any, traceback: Any) -> None:
        self._hooks.pop().__exit__(exc_type, exc, traceback)
        if exc_type is None and not self._hooks:
            # The outermost exit (a block's, or the model's when the part outside the blocks is
            # offloaded) waits for the copies out and raises a failed write; a block inside the
            # model's scope does not stall forward on them.
            self.session.forward_end()

    def flush(self) -> None:
        """Send out the resident window (what the next offloaded block's saves would push out)."""
        for _ in range(max(1, self.prefetch)):
            self.session.start_group()
        self.session.forward_end()

    def __reduce__(self) -> tuple[Any, ...]:
        # Copies get a fresh schedule (pickle's memo keeps one per model when blocks go together).
        return (SharedOffload, (self.storage, self.prefetch, self.in_flight))


def copies_outlive_blocks(choices: list[str], device: torch.device) -> bool:
    """Whether an offloaded block's copies out may still be in flight once its forward has returned,
    for the offload tiers among ``choices`` on ``device``: a block's scope waits at its exit for the
    copies that may fail (``OffloadSession.forward_end``, ``Backend.copy_out_can_fail``: every copy on
    CPU, the disk tier's on CUDA), and not for the others (the CUDA host tier's)."""
    tiers = {choice.partition(":")[2] for choice in choices if is_offload(choice)}
    try:
        backend = backend_for(device)
    except NotImplementedError:  # a device kind without a backend: assume the worst
        return bool(tiers)
    # copy_out_can_fail reads the tier's kind only
    return any(not backend.copy_out_can_fail(SimpleNamespace(kind=tier)) for tier in tiers)  # type: ignore[arg-type]


def offload_scopes(choices: list[str], outside: str, prefetch: int, in_flight: int) -> dict[str, SharedOffload]:
    """One ``SharedOffload`` per tier that ``choices`` (the blocks') or ``outside`` offload to, letting
    ``in_flight`` bytes be in flight: the ``shared`` dict ``install``/``install_outside`` take."""
    offload_part = split_outside(outside)[0]
    tiers = [c.partition(":")[2] for c in [*choices, offload_part] if is_offload(c)]
    return {tier: SharedOffload(tier, prefetch, in_flight) for tier in dict.fromkeys(tiers)}


class OffloadedForward(CheckpointedForward):
    """The instance ``forward`` of a block whose saved tensors go to a storage tier (no recompute),
    through ``scope`` (a ``SharedOffload``, shared with the model's other offloaded blocks)."""

    def __init__(self, module: nn.Module, storage: str, prefetch: int, replaced: Any = MISSING,
                 scope: SharedOffload | None = None) -> None:
        super().__init__(module, RegionOptions(), replaced)
        self.storage, self.prefetch = storage, prefetch
        self.scope = scope if scope is not None else SharedOffload(storage, prefetch)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.plain_forward()(*args, **kwargs)
        with self.scope:
            return self.plain_forward()(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> OffloadedForward:
        new_module = copy.deepcopy(self.module, memo)
        replaced = self.replaced if self.replaced is MISSING else copy.deepcopy(self.replaced, memo)
        return OffloadedForward(new_module, self.storage, self.prefetch, replaced,
                                copy.deepcopy(self.scope, memo))

    def __reduce__(self) -> tuple[Any, ...]:
        return (OffloadedForward, (self.module, self.storage, self.prefetch, self.replaced, self.scope))


class ShieldedForward(CheckpointedForward):
    """The instance ``forward`` of a kept, selective or recomputed block when the part of the model
    outside the blocks is offloaded: the block runs as its choice says (``recompute``: a region
    with ``options``; else as it is) with what it saves, its region's input included, kept where it
    is (``no_offload``) instead of going through the offload scope around the model."""

    def __init__(self, module: nn.Module, options: RegionOptions, replaced: Any = MISSING,
                 recompute: bool = False) -> None:
        super().__init__(module, options, replaced)
        self.recompute = recompute

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from ..storage import no_offload

        if not torch.is_grad_enabled():
            return self.plain_forward()(*args, **kwargs)
        with no_offload():
            return super().__call__(*args, **kwargs) if self.recompute else self.plain_forward()(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> ShieldedForward:
        new_module = copy.deepcopy(self.module, memo)
        replaced = self.replaced if self.replaced is MISSING else copy.deepcopy(self.replaced, memo)
        return ShieldedForward(new_module, self.options, replaced, self.recompute)

    def __reduce__(self) -> tuple[Any, ...]:
        return (ShieldedForward, (self.module, self.options, self.replaced, self.recompute))


def choice_options(choice: str) -> RegionOptions:
    """The region options of a recomputing ``choice`` (selective, selective-alt, recompute,
    recompute+offload:TIER)."""
    base, _, tier = choice.partition(":")
    options = RegionOptions()
    if base == "selective":
        return options.replace(context_fn=save_ops())
    if base == "selective-alt":
        alternate = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        return options.replace(context_fn=save_ops(DEFAULT_SAVE_OPS, recompute_every_other=alternate))
    if base == "recompute+offload":
        from ..storage import boundary_offload

        # One session per block and no horizon: what the block's profile measured alone.
        return options.replace(saved_tensors_scope=boundary_offload(storage=tier, prefetch=0))
    if base != "recompute":
        raise ValueError(f"unknown planner choice {choice!r}")
    return options


def is_offload(choice: str) -> bool:
    """True for the choices whose saved tensors go through the model's shared offload schedule."""
    return choice.partition(":")[0] == "offload"


def moves_data(choice: str) -> bool:
    """True for the choices that copy to a storage tier (the offload choices, and ``ASKED``: the
    script's policy offloads), whose time the cost model charges for the copies."""
    return "offload" in choice or choice == ASKED


def install(block: nn.Module, choice: str, prefetch: int = 2, shared: dict[str, SharedOffload] | None = None,
            *, within_offload: bool = False) -> None:
    """Make ``block`` run as ``choice`` (in place; ``keep`` removes a region the planner installed).
    ``shared``: tier -> ``SharedOffload`` of the model (filled in as needed); pass one dict for all the
    blocks of a model so its offloaded blocks share one schedule. ``within_offload``: the model
    around the block is offloaded (outside choice), so the choices that offload nothing keep the
    block out of it (``ShieldedForward``); the offload choices use their own scope inside it."""
    base, _, tier = choice.partition(":")
    existing = checkpointed_forward_of(block)
    if existing is not None:
        block.__dict__.pop(APPLIED_ATTRIBUTE, None)
        uncheckpoint_module(block)
    if base == ASKED:  # the block's own checkpoint call (the script's policy) stays as it is
        return
    if within_offload and base in ("keep", "selective", "selective-alt", "recompute"):
        recompute = base != "keep"
        options = choice_options(choice) if recompute else RegionOptions()
        block.forward = ShieldedForward(block, options, block.__dict__.get("forward", MISSING), recompute)
        block.__dict__[APPLIED_ATTRIBUTE] = block.__dict__["forward"]
        return
    if base == "keep":
        return
    if base == "offload":
        replaced = block.__dict__.get("forward", MISSING)
        scope = None
        if shared is not None:
            scope = shared.get(tier)
            if scope is None or scope.prefetch != prefetch:
                scope = shared[tier] = SharedOffload(tier, prefetch)
        block.forward = OffloadedForward(block, tier, prefetch, replaced, scope)
    else:
        options = choice_options(choice)
        checkpoint_module(block, options)
    block.__dict__[APPLIED_ATTRIBUTE] = block.__dict__["forward"]


def outside_choices(model: nn.Module, choices: tuple[str, ...] | list[str]) -> list[str]:
    """The choices for the part of ``model`` outside its blocks: ``keep``; ``offload:TIER`` per tier
    among ``choices``; where the model has an LM head ``acshim.head`` can run, ``loss`` (the
    cross-entropy keeps the logits, not its log-softmax) and ``head`` (head and loss in chunks of the
    sequence, the head recomputed in backward), each also with the rest offloaded
    (``offload:TIER+head``)."""
    from .. import head

    tiers = list(dict.fromkeys(c.partition(":")[2] for c in choices if is_offload(c)))
    heads = list(head.MODES) if head.available(model) else []
    return ["keep", *(f"offload:{t}" for t in tiers), *heads, *(f"offload:{t}+{h}" for t in tiers for h in heads)]


def split_outside(outside: str) -> tuple[str, str | None]:
    """``(offload part, head mode)`` of an outside choice: ``offload:disk+head`` -> ``("offload:disk",
    "head")``, ``head`` -> ``("keep", "head")``."""
    from .. import head

    first, _, second = outside.partition("+")
    if first in head.MODES and not second:
        return "keep", first
    if second and second not in head.MODES:
        raise ValueError(f"unknown outside choice {outside!r}: keep, offload:TIER, {'/'.join(head.MODES)} or "
                         f"offload:TIER+{'/'.join(head.MODES)}")
    return first, second or None


def install_outside(model: nn.Module, outside: str, prefetch: int = 2,
                    shared: dict[str, SharedOffload] | None = None) -> None:
    """Make the part of ``model`` outside its blocks run as ``outside``: ``keep``, ``offload:TIER``
    (an offload scope around the model's forward, sharing the offloaded blocks' schedule through
    ``shared``; the blocks' own choices take precedence inside them), ``loss`` / ``head``
    (``acshim.head``'s modes for the LM head and its cross-entropy) or both (``offload:TIER+head``).
    Only what the planner installed is replaced or removed."""
    from .. import head

    offload, mode = split_outside(outside)
    if mode is None:
        head.remove(model)
    elif head.installed_mode(model) != mode and not head.install(model, mode):
        raise ValueError(f"outside choice {outside!r}: {type(model).__name__} has no LM head acshim.head can run")
    ours = isinstance(model.__dict__.get(APPLIED_ATTRIBUTE), OffloadedForward) and model.__dict__.get(
        "forward") is model.__dict__.get(APPLIED_ATTRIBUTE)
    if offload == "keep":
        if ours:
            install(model, "keep")
        return
    if not is_offload(offload):
        raise ValueError(f"unknown outside choice {outside!r}: keep or offload:TIER")
    if checkpointed_forward_of(model) is not None and not ours:
        raise ValueError(f"{type(model).__name__} is itself a checkpointed region; the part outside its blocks "
                         "cannot also be offloaded (remove its checkpointing first)")
    install(model, offload, prefetch, shared)
