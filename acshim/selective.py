"""Selective-op checkpointing: inside a region, keep the outputs of chosen operators and recompute
the rest. Built on ``torch.utils.checkpoint.create_selective_checkpoint_contexts``; the result is a
``context_fn`` for ``RegionOptions`` / ``acshim.checkpoint`` (non-reentrant regions only).

The "save every other matmul" rule is the one torchtitan and Modalities use
(torchtitan/distributed/activation_checkpoint.py, modalities activation_checkpointing.py): the 1st,
3rd, 5th... ``mm`` of a region is saved, the others recomputed; counters are per region call and
kept apart for forward and recompute.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

ContextFn = Callable[[], tuple[AbstractContextManager[Any], AbstractContextManager[Any]]]

aten = torch.ops.aten

#: Compute-heavy operators worth keeping (matmuls and attention), a sensible default save list.
DEFAULT_SAVE_OPS: tuple[Any, ...] = (
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
)


def resolve_op(op: Any) -> Any:
    """An ``OpOverload`` from an overload, or from a dotted name such as ``"aten.mm.default"``."""
    if isinstance(op, torch._ops.OpOverload):
        return op
    if isinstance(op, torch._ops.OpOverloadPacket):
        raise ValueError(f"{op} is an operator packet; name one overload, e.g. {op}.default")
    if isinstance(op, str):
        target: Any = torch.ops
        for part in op.removeprefix("ops.").removeprefix("torch.ops.").split("."):
            target = getattr(target, part, None)
            if target is None:
                raise ValueError(f"unknown operator {op!r}; name an overload such as 'aten.mm.default'")
        return resolve_op(target)
    raise TypeError(f"expected an operator overload or its dotted name, got {type(op).__name__}")


class _SaveOpsPolicy:
    """Per region call: MUST_SAVE listed ops, PREFER_RECOMPUTE the rest (and every other mm)."""

    def __init__(self, save: frozenset[Any], alternate: frozenset[Any]) -> None:
        self.save, self.alternate = save, alternate
        self.counts = {False: 0, True: 0}  # alternating-op count in forward and in recompute

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in self.alternate:
            recompute = bool(getattr(ctx, "is_recompute", False))
            self.counts[recompute] += 1
            if self.counts[recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in self.save else CheckpointPolicy.PREFER_RECOMPUTE


def save_ops(ops: Iterable[Any] = DEFAULT_SAVE_OPS, *, recompute_every_other: Iterable[Any] = ()) -> ContextFn:
    """A ``context_fn`` that saves the outputs of ``ops`` inside the region and recomputes the rest.

    ``recompute_every_other``: operators of which only the 1st, 3rd, 5th... call is saved (torchtitan's
    and Modalities' rule for ``aten.mm.default``).

    >>> acshim.apply_checkpointing(model, context_fn=acshim.selective.save_ops())
    """
    save = frozenset(resolve_op(op) for op in ops)
    alternate = frozenset(resolve_op(op) for op in recompute_every_other)
    if not save:
        raise ValueError("save_ops needs at least one operator to save; to save nothing use full checkpointing")

    def context_fn() -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
        return create_selective_checkpoint_contexts(_SaveOpsPolicy(save, alternate))

    return functools.update_wrapper(context_fn, save_ops)
