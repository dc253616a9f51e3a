"""The chunked cross-entropy: ``cross_entropy`` (torch's signature, values and gradients bitwise), the
``HeadLogits`` tensor type that routes ``F.cross_entropy`` of an installed head's logits to it, and the
two autograd functions (the loss keeping its input; the loss handing its gradient to the head)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .chunks import (
    REDUCTIONS,
    HeadConfig,
    PendingLoss,
    chunk_rows,
    gather_targets,
    logits_grad,
    loss_value,
    row_checksums,
    rows_grad,
)
from .projection import head_rows

_TORCH_CROSS_ENTROPY = F.cross_entropy


class HeadLogits(torch.Tensor):
    """Logits of an installed head. ``F.cross_entropy`` on them (or a view) runs the chunked loss;
    every other operation returns plain tensors (views keep the type, so the loss still finds them)."""

    _acshim_head: HeadConfig

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is _TORCH_CROSS_ENTROPY:
            return cross_entropy(*args, **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if func in _KEEPS_PROVENANCE and isinstance(out, torch.Tensor) and out.is_floating_point():
            source = next(a for a in args if isinstance(a, HeadLogits))
            out = as_logits(out, source._acshim_head)
        return out


_KEEPS_PROVENANCE = {torch.Tensor.view, torch.Tensor.reshape, torch.Tensor.flatten, torch.Tensor.float,
                     torch.Tensor.to, torch.Tensor.contiguous, torch.Tensor.__getitem__, torch.Tensor.view_as,
                     torch.Tensor.reshape_as, torch.flatten, torch.reshape}


def as_logits(tensor: torch.Tensor, config: HeadConfig) -> HeadLogits:
    out = tensor.as_subclass(HeadLogits)
    out._acshim_head = config
    return out


def _plain(tensor: Any) -> Any:
    return tensor.as_subclass(torch.Tensor) if isinstance(tensor, HeadLogits) else tensor


def cross_entropy(input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                  size_average: bool | None = None, ignore_index: int = -100, reduce: bool | None = None,
                  reduction: str = "mean", label_smoothing: float = 0.0, *, chunk_bytes: int | None = None
                  ) -> torch.Tensor:
    """``torch.nn.functional.cross_entropy`` (same signature, values and gradients bitwise) computed
    in chunks of rows: it keeps its input instead of its log-softmax output, and, for logits of a
    head installed in ``head`` mode, nothing of them (the head recomputes them in backward). Forms
    it does not chunk (class weights, label smoothing, probability targets, inputs other than
    ``(N, C)``, no grad) run as torch's."""
    config = input._acshim_head if isinstance(input, HeadLogits) else HeadConfig(mode="loss")
    plain_input, plain_target = _plain(input), _plain(target)
    chunkable = (weight is None and size_average is None and reduce is None and label_smoothing == 0.0
                 and reduction in REDUCTIONS and plain_input.dim() == 2 and plain_target.dim() == 1
                 and plain_input.is_floating_point() and not plain_target.is_floating_point()
                 and plain_input.requires_grad and torch.is_grad_enabled() and not torch.compiler.is_compiling())
    if not chunkable or _out_of_range(plain_target, ignore_index, plain_input.shape[1]):
        # torch's own result, or its own error for a bad target
        return _TORCH_CROSS_ENTROPY(plain_input, plain_target, weight, size_average, ignore_index, reduce,
                                    reduction, label_smoothing)
    chunk_bytes = chunk_bytes if chunk_bytes is not None else config.chunk_bytes
    rows = head_rows(input, config) if config.mode == "head" else None
    if rows is None:
        return _RecomputedLoss.apply(plain_input, plain_target, ignore_index, reduction, chunk_bytes)
    return _FusedLoss.apply(plain_input, plain_target, ignore_index, reduction, chunk_bytes, config, rows)


def _out_of_range(target: torch.Tensor, ignore_index: int, classes: int) -> bool:
    valid = target != ignore_index
    return bool(((target < 0) | (target >= classes)).logical_and(valid).any())


class _RecomputedLoss(torch.autograd.Function):
    """Cross-entropy keeping its input, the log-softmax recomputed per chunk in backward."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str,
                chunk_bytes: int) -> torch.Tensor:
        chunks = chunk_rows(input.shape[0], input.shape[1], input.element_size(), chunk_bytes)
        picked = [gather_targets(torch._log_softmax(input[s:e], 1, False), target[s:e], ignore_index) for s, e in chunks]
        loss, total_weight = loss_value(picked, target, ignore_index, reduction)
        ctx.save_for_backward(input, target, total_weight)
        ctx.chunks, ctx.ignore_index, ctx.reduction = chunks, ignore_index, reduction
        return loss

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        input, target, total_weight = ctx.saved_tensors
        grad = torch.empty_like(input)
        for start, end in ctx.chunks:
            lp = torch._log_softmax(input[start:end], 1, False)
            grad[start:end] = logits_grad(rows_grad(grad_out, start, end, ctx.reduction), lp, target[start:end],
                                           ctx.ignore_index, ctx.reduction, total_weight)
        return grad, None, None, None, None


class _FusedLoss(torch.autograd.Function):
    """Cross-entropy of a ``head``-mode head's logits: the value from the logits given (they exist in
    forward), nothing of them kept; its backward hands the gradient to the head's (``PendingLoss``)."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str,
                chunk_bytes: int, config: HeadConfig, rows: torch.Tensor) -> torch.Tensor:
        chunks = chunk_rows(input.shape[0], input.shape[1], 4, chunk_bytes)
        picked, sums = [], []
        for start, end in chunks:
            part = input[start:end]
            sums.append(row_checksums(part))
            picked.append(gather_targets(torch._log_softmax(part, 1, False), target[start:end], ignore_index))
        loss, total_weight = loss_value(picked, target, ignore_index, reduction)
        ctx.save_for_backward(target, total_weight)
        ctx.node, ctx.rows, ctx.sums = config.node, rows, torch.cat(sums)
        ctx.ignore_index, ctx.reduction, ctx.dtype = ignore_index, reduction, input.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        target, total_weight = ctx.saved_tensors
        ctx.node.pending.append(PendingLoss(ctx.rows, target, grad_out, total_weight, ctx.sums, ctx.ignore_index,
                                     ctx.reduction, ctx.dtype))
        return (None,) * 7
