"""The head's projection as an autograd function (``HeadProjection``): it keeps what ``F.linear``
keeps, and with a fused loss pending its backward recomputes the logits chunk by chunk; and the
provenance check (``head_rows``) that finds which of its rows a loss's input is."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointError

from .chunks import HeadConfig, PendingLoss, chunk_rows, logits_grad, row_checksums


class HeadProjection(torch.autograd.Function):
    """``F.linear(hidden, weight, bias)`` keeping what linear keeps; with a fused loss pending, its
    backward recomputes the logits chunk by chunk (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                config: HeadConfig) -> torch.Tensor:
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, bias)
        # scalars only: the config refers to this node, and a reference back would make a cycle that keeps
        # the saved hidden states alive until the garbage collector runs
        ctx.chunk_bytes, ctx.exact, ctx.pending = config.chunk_bytes, config.exact, []
        return F.linear(hidden, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_logits: torch.Tensor | None) -> tuple[Any, ...]:
        hidden, weight, bias = ctx.saved_tensors
        pending, ctx.pending = ctx.pending, []
        needs = ctx.needs_input_grad[:3]
        if not pending and grad_logits is None:
            return None, None, None, None
        frozen = not needs[1] and not needs[2]
        if pending and len(pending) == 1 and (frozen or not ctx.exact):
            return (*_chunked_backward(hidden, weight, bias, grad_logits, pending[0], ctx.chunk_bytes, needs), None)
        grad = _full_grad(hidden, weight, bias, grad_logits, pending, ctx.chunk_bytes)
        return (*_linear_backward(hidden, weight, bias, grad, needs), None)


def chunk_logits_grad(hidden2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, start: int,
                       end: int, entry: PendingLoss, inverse: torch.Tensor) -> torch.Tensor:
    """Rows ``start:end`` of the gradient of the head's logits from the fused loss ``entry``."""
    logits = F.linear(hidden2d[start:end], weight, bias)
    index = inverse[start:end]
    used = index >= 0
    safe = index.clamp(min=0)
    x = logits.to(entry.dtype)
    if used.any():
        sums = row_checksums(x[used])
        if not torch.equal(sums, entry.checksums[safe[used]]):
            raise CheckpointError(
                "acshim.head: the logits recomputed for backward differ from those of the forward (the BLAS "
                "here does not give a matmul's rows bitwise for a chunk of them, or the head's input or weight "
                "changed in place). Remove the chunked head (acshim.head.remove(model), or plan without it).")
    lp = torch._log_softmax(x, 1, False)
    target = torch.where(used, entry.target[safe], torch.full_like(safe, entry.ignore_index))
    if entry.reduction == "none":
        grad_out = torch.where(used, entry.grad_out[safe],
                               torch.zeros((), dtype=entry.grad_out.dtype, device=entry.grad_out.device))
    else:
        grad_out = entry.grad_out
    grad = logits_grad(grad_out, lp, target, entry.ignore_index, entry.reduction, entry.total_weight)
    return grad.to(logits.dtype)


def inverse_rows(entry: PendingLoss, rows: int) -> torch.Tensor:
    inverse = torch.full((rows,), -1, dtype=torch.int64, device=entry.rows.device)
    inverse[entry.rows] = torch.arange(entry.rows.numel(), device=entry.rows.device)
    return inverse


def _chunked_backward(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      grad_logits: torch.Tensor | None, entry: PendingLoss, chunk_bytes: int,
                      needs: tuple[bool, ...]) -> tuple[Any, Any, Any]:
    """Per chunk: logits recomputed, their gradient, its product with the weight (rows of the whole
    matmul), and with ``exact=False`` the chunk's share of the weight's and bias's gradients."""
    hidden2d = hidden.reshape(-1, hidden.shape[-1])
    vocab = weight.shape[0]
    other = grad_logits.reshape(-1, vocab) if grad_logits is not None else None
    inverse = inverse_rows(entry, hidden2d.shape[0])
    grad_hidden = torch.empty_like(hidden2d) if needs[0] else None
    grad_weight = torch.zeros_like(weight) if needs[1] else None
    grad_bias = torch.zeros_like(bias) if bias is not None and needs[2] else None
    for start, end in chunk_rows(hidden2d.shape[0], vocab, 4, chunk_bytes):
        grad = chunk_logits_grad(hidden2d, weight, bias, start, end, entry, inverse)
        if other is not None:
            grad = other[start:end] + grad
        if grad_hidden is not None:
            grad_hidden[start:end] = grad.mm(weight)
        if grad_weight is not None:
            grad_weight += grad.t().mm(hidden2d[start:end])
        if grad_bias is not None:
            grad_bias += grad.sum(0)
    return (grad_hidden.view(hidden.shape) if grad_hidden is not None else None), grad_weight, grad_bias


def _full_grad(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               grad_logits: torch.Tensor | None, pending: list[PendingLoss], chunk_bytes: int) -> torch.Tensor:
    """The whole gradient of the head's logits: other uses' (``grad_logits``) plus each fused loss's,
    filled chunk by chunk."""
    hidden2d = hidden.reshape(-1, hidden.shape[-1])
    vocab = weight.shape[0]
    grad = (grad_logits.reshape(-1, vocab).clone() if grad_logits is not None
            else torch.zeros(hidden2d.shape[0], vocab, dtype=hidden.dtype, device=hidden.device))
    for entry in pending:
        inverse = inverse_rows(entry, hidden2d.shape[0])
        for start, end in chunk_rows(hidden2d.shape[0], vocab, 4, chunk_bytes):
            part = chunk_logits_grad(hidden2d, weight, bias, start, end, entry, inverse)
            if grad_logits is None and len(pending) == 1:
                grad[start:end] = part
            else:
                grad[start:end] += part
    return grad.view(*hidden.shape[:-1], vocab)


def _linear_backward(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, grad: torch.Tensor,
                     needs: tuple[bool, ...]) -> tuple[Any, Any, Any]:
    """``F.linear``'s own backward for ``grad``. Without a bias, on contiguous operands: the two
    matmuls autograd runs for it (``matmul`` folds the input to 2-D and calls ``mm``; ``mm``'s
    backward gives ``grad @ weight`` and, the weight's transpose being column-major,
    ``grad.t() @ input``: torch's ``mm_mat1_backward`` / ``mm_mat2_backward``), so the logits are
    not computed again: the head's backward holds their gradient, not a second logits-sized
    output beside it (62.5 MiB less on a 32k vocabulary at 512 tokens). Otherwise autograd on
    ``F.linear`` run again: bitwise by construction, whatever the layout, at the cost of its
    forward. tests/engine/test_head.py checks the first against the second bitwise."""
    if bias is None and hidden.is_contiguous() and weight.is_contiguous() and grad.is_contiguous() \
            and hidden.dim() >= 2 and weight.dim() == 2 and not hidden.is_complex():
        hidden2d = hidden.reshape(-1, hidden.shape[-1])
        grad2d = grad.reshape(-1, weight.shape[0])
        grad_hidden = grad2d.mm(weight).view(hidden.shape) if needs[0] else None
        grad_weight = grad2d.t().mm(hidden2d) if needs[1] else None
        return grad_hidden, grad_weight, None
    return _linear_backward_by_autograd(hidden, weight, bias, grad, needs)


def _linear_backward_by_autograd(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                 grad: torch.Tensor, needs: tuple[bool, ...]) -> tuple[Any, Any, Any]:
    """``F.linear``'s backward by autograd on ``F.linear`` run again (any layout, a bias)."""
    inputs = [t.detach().requires_grad_(need) for t, need in zip((hidden, weight), needs[:2], strict=True)]
    extra = [bias.detach().requires_grad_(needs[2])] if bias is not None else []
    wanted = [t for t in (*inputs, *extra) if t.requires_grad]
    with torch.enable_grad():
        out = F.linear(inputs[0], inputs[1], extra[0] if extra else None)
        grads = iter(torch.autograd.grad(out, wanted, grad))
    result = [next(grads) if t.requires_grad else None for t in (*inputs, *extra)]
    return result[0], result[1], (result[2] if extra else None)


def _unsigned(value: int) -> int:
    return value - 2**64 if value >= 2**63 else value


def head_rows(input: torch.Tensor, config: HeadConfig) -> torch.Tensor | None:
    """For each row of ``input`` (``(N, V)``), the row of the head's output it is (a view, slice,
    copy or cast of it), or None when ``input`` came some other way (then the loss keeps its input)."""
    node = config.node
    if node is None:
        return None
    steps: list[tuple[str, Any]] = []
    shape = tuple(input.shape)
    fn = input.grad_fn
    casts = 0
    while fn is not None and fn is not node:
        name = type(fn).__name__
        if name in ("ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0"):
            before = tuple(fn._saved_self_sym_sizes)
            steps.append(("view", shape))
        elif name == "SliceBackward0":
            before = tuple(fn._saved_self_sym_sizes)
            steps.append(("slice", (fn._saved_dim, _unsigned(fn._saved_start), _unsigned(fn._saved_end),
                                    fn._saved_step)))
        elif name == "SelectBackward0":
            before = tuple(fn._saved_self_sym_sizes)
            steps.append(("select", (fn._saved_dim, _unsigned(fn._saved_index))))
        elif name in ("CloneBackward0", "ToCopyBackward0", "AliasBackward0"):  # alias: ``as_subclass``
            before = shape
            casts += name == "ToCopyBackward0"
        else:
            return None
        if len(before) < 1 or before[-1] != config.shape[-1] or shape[-1] != config.shape[-1]:
            return None  # the vocabulary dimension was reshaped or sliced
        shape = before
        fn = fn.next_functions[0][0] if fn.next_functions else None
    if fn is not node or shape != config.shape or casts > 1:
        return None
    index = torch.arange(math.prod(config.shape[:-1]), device=input.device).view(*config.shape[:-1], 1)
    for kind, argument in reversed(steps):
        if kind == "view":
            index = index.reshape(*argument[:-1], 1)
        elif kind == "slice":
            dim, start, end, step = argument
            dim = dim % index.dim()
            if dim == index.dim() - 1:
                return None
            index = index[(slice(None),) * dim + (slice(start, end, step),)]
        else:
            dim, position = argument
            dim = dim % index.dim()
            if dim == index.dim() - 1:
                return None
            index = index.select(dim, position)
    if tuple(index.shape[:-1]) != tuple(input.shape[:-1]):
        return None
    return index.reshape(-1)
