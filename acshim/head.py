"""The LM head and its cross-entropy in chunks of the sequence, with torch's own gradients.

What dominates a language model's training memory at a large vocabulary lies outside the blocks:
the logits (tokens x vocabulary) and what ``F.cross_entropy`` keeps of them for backward (its
log-softmax output), then the same sizes again in backward (the log-softmax's and the logits'
gradients). Fused and chunked cross-entropy kernels (Liger's, torchtune's chunked loss, Apple's
CCE, TRL's fused head) avoid that by working on a few tokens at a time. This module does the same
with torch's own kernels, so the gradients are those of ``F.cross_entropy`` bitwise:

- ``loss`` mode: the cross-entropy keeps its input (the logits) instead of its log-softmax output and
  recomputes the log-softmax chunk by chunk in backward, through ``torch.ops.aten.nll_loss_backward``
  and ``torch._log_softmax_backward_data``: the step holds one copy of the logits, not two or three.
- ``head`` mode: the output projection (``lm_head``) is run by ``_Head``, which keeps only its input
  (the hidden states); a cross-entropy of its logits keeps nothing of them either, and the head's
  backward recomputes logits, log-softmax and gradients chunk by chunk. The logits still exist in
  forward (the model returns them), and are freed when the caller drops them.
- TRL's fused head (``SFTTrainer``'s ``fused_lm_head``) already works in tiles of tokens, 4096 by
  default, with several tile-sized temporaries on CPU: ``head`` mode runs its tiles at the chunk size.

Exactness. Every kernel used per chunk computes rows independently (log-softmax, its backward,
``nll_loss_backward`` given the whole batch's ``total_weight``), and the loss value comes from torch's
own ``nll_loss`` over the gathered per-token values, whose summation depends only on their number.
The head's matmuls per chunk give the rows of the whole matmul (measured on this BLAS for chunks of
16 rows or more; chunks are never smaller, and a batch at most one chunk runs whole): the forward's
logits are checked against their recompute (an integer checksum per row) and a mismatch raises
``CheckpointError``. A frozen head (LoRA, PEFT) gets bitwise gradients throughout. A trainable head's
weight gradient is a sum over tokens: by default (``exact=True``) the chunks fill one logits-sized
gradient and the head's backward runs whole, as torch's linear does (bitwise; still a third of the
memory); ``exact=False`` sums the chunks' products instead (the order of that sum differs from one
matmul's: a few float32 ulps; see ``tests/engine/test_head.py``).

A tensor the head returns is a ``HeadLogits`` (a ``torch.Tensor`` subclass): ``F.cross_entropy`` (or
``nn.CrossEntropyLoss``, or Hugging Face's loss) called on it, or on a view of it, comes here through
``__torch_function__``. Nothing global is patched; any other use of the logits gets plain tensors.

>>> with acshim.head.chunked(model):           # or acshim.head.install(model) / remove(model)
...     loss = model(input_ids=ids, labels=labels).loss
...     loss.backward()
>>> loss = acshim.head.cross_entropy(logits.view(-1, vocab), targets)   # the loss alone, loss mode
"""

from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointError

__all__ = ["DEFAULT_CHUNK_BYTES", "MODES", "HeadLogits", "chunked", "cross_entropy", "find_head", "install",
           "installed_mode", "remove"]

MODES = ("loss", "head")
DEFAULT_CHUNK_BYTES = 4 * 2**20
"""Bytes of one chunk's logits (float32 rows of the vocabulary); a chunk's backward holds about four."""
MIN_ROWS = 16
"""Fewest rows per chunk: the BLAS here gives a matmul's rows bitwise only from about 12 rows on."""

_TORCH_CROSS_ENTROPY = F.cross_entropy
_REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}


@dataclass
class HeadConfig:
    """How a head's logits are treated: ``mode`` (``loss`` or ``head``), bytes per chunk, exactness of
    a trainable head's weight gradient."""

    mode: str = "head"
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    exact: bool = True
    node: Any = None
    """``head`` mode: the ``_Head`` autograd node that produced the logits (their provenance)."""
    shape: tuple[int, ...] = ()
    """The head output's shape."""


def rows_per_chunk(width: int, itemsize: int, chunk_bytes: int) -> int:
    """Rows of ``width`` elements in about ``chunk_bytes``: a multiple of ``MIN_ROWS``, at least one."""
    return max(MIN_ROWS, (chunk_bytes // max(1, width * itemsize)) // MIN_ROWS * MIN_ROWS)


def chunk_rows(rows: int, width: int, itemsize: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """``(start, end)`` of each chunk of ``rows`` rows of ``width`` elements: about ``chunk_bytes``
    each and at most an eighth of the rows (so small batches are chunked too), a multiple of
    ``MIN_ROWS`` rows, a short remainder merged into the last chunk."""
    eighth = -(-rows // (8 * MIN_ROWS)) * MIN_ROWS
    size = min(rows_per_chunk(width, itemsize, chunk_bytes), max(MIN_ROWS, eighth))
    if rows <= size:
        return [(0, rows)]
    bounds = list(range(0, rows, size))
    if rows - bounds[-1] < MIN_ROWS:
        bounds.pop()
    return [(start, bounds[i + 1] if i + 1 < len(bounds) else rows) for i, start in enumerate(bounds)]


# ------------------------------------------------------------------------------------------ logits
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
            out = _as_logits(out, source._acshim_head)
        return out


_KEEPS_PROVENANCE = {torch.Tensor.view, torch.Tensor.reshape, torch.Tensor.flatten, torch.Tensor.float,
                     torch.Tensor.to, torch.Tensor.contiguous, torch.Tensor.__getitem__, torch.Tensor.view_as,
                     torch.Tensor.reshape_as, torch.flatten, torch.reshape}


def _as_logits(tensor: torch.Tensor, config: HeadConfig) -> HeadLogits:
    out = tensor.as_subclass(HeadLogits)
    out._acshim_head = config
    return out


def _plain(tensor: Any) -> Any:
    return tensor.as_subclass(torch.Tensor) if isinstance(tensor, HeadLogits) else tensor


# ------------------------------------------------------------------------------------------ the loss
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
                 and reduction in _REDUCTIONS and plain_input.dim() == 2 and plain_target.dim() == 1
                 and plain_input.is_floating_point() and not plain_target.is_floating_point()
                 and plain_input.requires_grad and torch.is_grad_enabled() and not torch.compiler.is_compiling())
    if not chunkable or _out_of_range(plain_target, ignore_index, plain_input.shape[1]):
        # torch's own result, or its own error for a bad target
        return _TORCH_CROSS_ENTROPY(plain_input, plain_target, weight, size_average, ignore_index, reduce,
                                    reduction, label_smoothing)
    chunk_bytes = chunk_bytes if chunk_bytes is not None else config.chunk_bytes
    rows = _head_rows(input, config) if config.mode == "head" else None
    if rows is None:
        return _RecomputedLoss.apply(plain_input, plain_target, ignore_index, reduction, chunk_bytes)
    return _FusedLoss.apply(plain_input, plain_target, ignore_index, reduction, chunk_bytes, config, rows)


def _out_of_range(target: torch.Tensor, ignore_index: int, classes: int) -> bool:
    valid = target != ignore_index
    return bool(((target < 0) | (target >= classes)).logical_and(valid).any())


def _loss_value(lp_rows: list[torch.Tensor], target: torch.Tensor, ignore_index: int, reduction: str
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, total_weight)`` exactly as ``nll_loss`` over the whole log-softmax: torch's own kernel
    on each row's value at its target (its sum depends only on the number of rows)."""
    target_class = 1 if ignore_index == 0 else 0
    gathered = torch.cat(lp_rows)
    if target_class:
        gathered = torch.cat([torch.zeros_like(gathered), gathered], dim=1)
    picked = torch.where(target == ignore_index, target, torch.full_like(target, target_class))
    return torch.ops.aten.nll_loss_forward(gathered, picked, None, _REDUCTIONS[reduction], ignore_index)


def _gather(lp: torch.Tensor, target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    return lp.gather(1, torch.where(target == ignore_index, 0, target).unsqueeze(1))


def _logits_grad(grad_out: torch.Tensor, lp: torch.Tensor, target: torch.Tensor, ignore_index: int,
                 reduction: str, total_weight: torch.Tensor) -> torch.Tensor:
    """The gradient of cross-entropy's input rows (torch's two backward kernels, row by row)."""
    grad_lp = torch.ops.aten.nll_loss_backward(grad_out, lp, target, None, _REDUCTIONS[reduction], ignore_index,
                                               total_weight)
    return torch._log_softmax_backward_data(grad_lp, lp, 1, lp.dtype)


def _rows_grad(grad_out: torch.Tensor, start: int, end: int, reduction: str) -> torch.Tensor:
    return grad_out[start:end] if reduction == "none" else grad_out


class _RecomputedLoss(torch.autograd.Function):
    """Cross-entropy keeping its input, the log-softmax recomputed per chunk in backward."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str,
                chunk_bytes: int) -> torch.Tensor:
        chunks = chunk_rows(input.shape[0], input.shape[1], input.element_size(), chunk_bytes)
        picked = [_gather(torch._log_softmax(input[s:e], 1, False), target[s:e], ignore_index) for s, e in chunks]
        loss, total_weight = _loss_value(picked, target, ignore_index, reduction)
        ctx.save_for_backward(input, target, total_weight)
        ctx.chunks, ctx.ignore_index, ctx.reduction = chunks, ignore_index, reduction
        return loss

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        input, target, total_weight = ctx.saved_tensors
        grad = torch.empty_like(input)
        for start, end in ctx.chunks:
            lp = torch._log_softmax(input[start:end], 1, False)
            grad[start:end] = _logits_grad(_rows_grad(grad_out, start, end, ctx.reduction), lp, target[start:end],
                                           ctx.ignore_index, ctx.reduction, total_weight)
        return grad, None, None, None, None


@dataclass
class _Pending:
    """A fused loss's gradient, handed to its head's backward."""

    rows: torch.Tensor
    target: torch.Tensor
    grad_out: torch.Tensor
    total_weight: torch.Tensor
    checksums: torch.Tensor
    ignore_index: int
    reduction: str
    dtype: torch.dtype


class _FusedLoss(torch.autograd.Function):
    """Cross-entropy of a ``head``-mode head's logits: the value from the logits given (they exist in
    forward), nothing of them kept; its backward hands the gradient to the head's (``_Pending``)."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str,
                chunk_bytes: int, config: HeadConfig, rows: torch.Tensor) -> torch.Tensor:
        chunks = chunk_rows(input.shape[0], input.shape[1], 4, chunk_bytes)
        picked, sums = [], []
        for start, end in chunks:
            part = input[start:end]
            sums.append(_checksum(part))
            picked.append(_gather(torch._log_softmax(part, 1, False), target[start:end], ignore_index))
        loss, total_weight = _loss_value(picked, target, ignore_index, reduction)
        ctx.save_for_backward(target, total_weight)
        ctx.node, ctx.rows, ctx.sums = config.node, rows, torch.cat(sums)
        ctx.ignore_index, ctx.reduction, ctx.dtype = ignore_index, reduction, input.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        target, total_weight = ctx.saved_tensors
        ctx.node.pending.append(_Pending(ctx.rows, target, grad_out, total_weight, ctx.sums, ctx.ignore_index,
                                     ctx.reduction, ctx.dtype))
        return (None,) * 7


def _checksum(rows: torch.Tensor) -> torch.Tensor:
    """An integer sum of each row's bits: equal rows give equal sums (order does not matter)."""
    bits = {4: torch.int32, 2: torch.int16, 8: torch.int64}[rows.element_size()]
    return rows.contiguous().view(bits).sum(1, dtype=torch.int64)


# ------------------------------------------------------------------------------------------ the head
class _Head(torch.autograd.Function):
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


def _chunk_logits_grad(hidden2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, start: int,
                       end: int, entry: _Pending, inverse: torch.Tensor) -> torch.Tensor:
    """Rows ``start:end`` of the gradient of the head's logits from the fused loss ``entry``."""
    logits = F.linear(hidden2d[start:end], weight, bias)
    index = inverse[start:end]
    used = index >= 0
    safe = index.clamp(min=0)
    x = logits.to(entry.dtype)
    if used.any():
        sums = _checksum(x[used])
        if not torch.equal(sums, entry.checksums[safe[used]]):
            raise CheckpointError(
                "acshim.head: the logits recomputed for backward differ from those of the forward (the BLAS "
                "here does not give a matmul's rows bitwise for a chunk of them, or the head's input or weight "
                "changed in place). Remove the chunked head (acshim.head.remove(model), or plan without it).")
    lp = torch._log_softmax(x, 1, False)
    target = torch.where(used, entry.target[safe], torch.full_like(safe, entry.ignore_index))
    if entry.reduction == "none":
        grad_out = torch.where(used, entry.grad_out[safe], torch.zeros((), dtype=entry.grad_out.dtype))
    else:
        grad_out = entry.grad_out
    grad = _logits_grad(grad_out, lp, target, entry.ignore_index, entry.reduction, entry.total_weight)
    return grad.to(logits.dtype)


def _inverse(entry: _Pending, rows: int) -> torch.Tensor:
    inverse = torch.full((rows,), -1, dtype=torch.int64)
    inverse[entry.rows] = torch.arange(entry.rows.numel())
    return inverse


def _chunked_backward(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      grad_logits: torch.Tensor | None, entry: _Pending, chunk_bytes: int,
                      needs: tuple[bool, ...]) -> tuple[Any, Any, Any]:
    """Per chunk: logits recomputed, their gradient, its product with the weight (rows of the whole
    matmul), and with ``exact=False`` the chunk's share of the weight's and bias's gradients."""
    hidden2d = hidden.reshape(-1, hidden.shape[-1])
    vocab = weight.shape[0]
    other = grad_logits.reshape(-1, vocab) if grad_logits is not None else None
    inverse = _inverse(entry, hidden2d.shape[0])
    grad_hidden = torch.empty_like(hidden2d) if needs[0] else None
    grad_weight = torch.zeros_like(weight) if needs[1] else None
    grad_bias = torch.zeros_like(bias) if bias is not None and needs[2] else None
    for start, end in chunk_rows(hidden2d.shape[0], vocab, 4, chunk_bytes):
        grad = _chunk_logits_grad(hidden2d, weight, bias, start, end, entry, inverse)
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
               grad_logits: torch.Tensor | None, pending: list[_Pending], chunk_bytes: int) -> torch.Tensor:
    """The whole gradient of the head's logits: other uses' (``grad_logits``) plus each fused loss's,
    filled chunk by chunk."""
    hidden2d = hidden.reshape(-1, hidden.shape[-1])
    vocab = weight.shape[0]
    grad = (grad_logits.reshape(-1, vocab).clone() if grad_logits is not None
            else torch.zeros(hidden2d.shape[0], vocab, dtype=hidden.dtype, device=hidden.device))
    for entry in pending:
        inverse = _inverse(entry, hidden2d.shape[0])
        for start, end in chunk_rows(hidden2d.shape[0], vocab, 4, chunk_bytes):
            part = _chunk_logits_grad(hidden2d, weight, bias, start, end, entry, inverse)
            if grad_logits is None and len(pending) == 1:
                grad[start:end] = part
            else:
                grad[start:end] += part
    return grad.view(*hidden.shape[:-1], vocab)


def _linear_backward(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, grad: torch.Tensor,
                     needs: tuple[bool, ...]) -> tuple[Any, Any, Any]:
    """``F.linear``'s own backward for ``grad`` (autograd on ``F.linear`` run again: bitwise by
    construction, whatever the layout, at the cost of its forward)."""
    inputs = [t.detach().requires_grad_(need) for t, need in zip((hidden, weight), needs[:2], strict=True)]
    extra = [bias.detach().requires_grad_(needs[2])] if bias is not None else []
    wanted = [t for t in (*inputs, *extra) if t.requires_grad]
    with torch.enable_grad():
        out = F.linear(inputs[0], inputs[1], extra[0] if extra else None)
        grads = iter(torch.autograd.grad(out, wanted, grad))
    result = [next(grads) if t.requires_grad else None for t in (*inputs, *extra)]
    return result[0], result[1], (result[2] if extra else None)


# ------------------------------------------------------------------------------------------ provenance
def _unsigned(value: int) -> int:
    return value - 2**64 if value >= 2**63 else value


def _head_rows(input: torch.Tensor, config: HeadConfig) -> torch.Tensor | None:
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
    index = torch.arange(int(torch.tensor(config.shape[:-1]).prod())).view(*config.shape[:-1], 1)
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


# ------------------------------------------------------------------------------------------ install
class HeadForward:
    """The instance ``forward`` of an output projection (``nn.Linear``) run by this module."""

    def __init__(self, module: nn.Linear, mode: str, chunk_bytes: int, exact: bool) -> None:
        self.module, self.mode, self.chunk_bytes, self.exact = module, mode, chunk_bytes, exact

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        module = self.module
        if not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return F.linear(hidden, module.weight, module.bias)
        config = HeadConfig(self.mode, self.chunk_bytes, self.exact)
        if self.mode == "loss" or not (hidden.requires_grad or module.weight.requires_grad):
            config.mode = "loss"
            return _as_logits(F.linear(hidden, module.weight, module.bias), config)
        logits = _Head.apply(hidden, module.weight, module.bias, config)
        config.node, config.shape = logits.grad_fn, tuple(logits.shape)
        return _as_logits(logits, config)

    def __reduce__(self) -> tuple[Any, ...]:
        return (HeadForward, (self.module, self.mode, self.chunk_bytes, self.exact))


def find_head(model: nn.Module) -> nn.Linear | None:
    """The model's output projection: ``get_output_embeddings()`` of a Hugging Face model (PEFT's
    wrappers included) when it is a plain ``nn.Linear``; None otherwise."""
    for module in model.modules():
        getter = getattr(type(module), "get_output_embeddings", None)
        if getter is None:
            continue
        try:
            head = module.get_output_embeddings()
        except (AttributeError, NotImplementedError, TypeError):
            continue
        if type(head) is nn.Linear:
            return head
    return None


@dataclass
class _Installed:
    head: nn.Linear | None
    mode: str
    trl_chunk: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class HeadInstalls:
    """What ``install`` put on which model, keyed by the model's identity and held weakly: an entry
    leaves with its model, so a new model that happens to get a collected one's ``id`` is never
    taken for installed. Also TRL's own ``TOKEN_CHUNK_SIZE``, kept to be put back."""

    def __init__(self) -> None:
        self._records: dict[int, tuple[weakref.ref[nn.Module], _Installed]] = {}
        self.trl_default: int | None = None

    def get(self, model: nn.Module) -> _Installed | None:
        entry = self._records.get(id(model))
        return entry[1] if entry is not None and entry[0]() is model else None

    def put(self, model: nn.Module, record: _Installed) -> None:
        key = id(model)
        self._records[key] = (weakref.ref(model, functools.partial(self._forget, key)), record)

    def pop(self, model: nn.Module) -> _Installed | None:
        record = self.get(model)
        if record is not None:
            del self._records[id(model)]
        return record

    def records(self) -> list[_Installed]:
        """The records of the models still alive."""
        return [record for ref, record in self._records.values() if ref() is not None]

    def __len__(self) -> int:
        return len(self.records())

    def _forget(self, key: int, ref: weakref.ref[nn.Module]) -> None:
        entry = self._records.get(key)
        if entry is not None and entry[0] is ref:
            del self._records[key]


INSTALLS = HeadInstalls()
_TRL_KERNEL = "trl.kernels.chunked_logprob"


def install(model: nn.Module, mode: str = "head", *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
            exact: bool = True) -> bool:
    """Run ``model``'s head and cross-entropy in chunks (``mode``: ``loss`` or ``head``, see the module
    docstring); in ``head`` mode TRL's fused head (when imported) runs its token tiles at the chunk
    size too. Returns False when the model has neither a head this module can run nor TRL's fused
    head. ``remove(model)`` undoes it."""
    if mode not in MODES:
        raise ValueError(f"acshim.head.install: mode must be one of {MODES}, got {mode!r}")
    if not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
        raise ValueError(f"acshim.head.install: chunk_bytes must be a positive int, got {chunk_bytes!r}")
    remove(model)
    head = find_head(model)
    trl = sys.modules.get(_TRL_KERNEL) if mode == "head" and _fused_by_trl(model) else None
    if head is None and trl is None:
        return False
    record = _Installed(head, mode)
    if head is not None:
        head.forward = HeadForward(head, mode, chunk_bytes, exact)
    if trl is not None:
        if INSTALLS.trl_default is None:
            INSTALLS.trl_default = trl.TOKEN_CHUNK_SIZE
        vocab = head.weight.shape[0] if head is not None else _trl_vocab(model)
        record.trl_chunk = rows_per_chunk(vocab, 4, chunk_bytes)
        trl.TOKEN_CHUNK_SIZE = record.trl_chunk
    INSTALLS.put(model, record)
    return True


def remove(model: nn.Module) -> None:
    """Undo ``install`` (nothing to do when it was not installed)."""
    record = INSTALLS.pop(model)
    if record is None:
        return
    if record.head is not None and isinstance(record.head.__dict__.get("forward"), HeadForward):
        del record.head.forward
    if record.trl_chunk is not None and not any(r.trl_chunk for r in INSTALLS.records()) \
            and INSTALLS.trl_default is not None:
        trl = sys.modules.get(_TRL_KERNEL)
        if trl is not None:
            trl.TOKEN_CHUNK_SIZE = INSTALLS.trl_default


def installed_mode(model: nn.Module) -> str | None:
    """The mode ``install`` put on ``model``, None when none."""
    record = INSTALLS.get(model)
    return record.mode if record is not None else None


def available(model: nn.Module) -> bool:
    """Whether ``install`` has something to run on ``model`` (a plain linear head, or TRL's fused head)."""
    return find_head(model) is not None or (_TRL_KERNEL in sys.modules and _fused_by_trl(model))


@contextlib.contextmanager
def chunked(model: nn.Module, mode: str = "head", *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
            exact: bool = True) -> Iterator[bool]:
    """``install`` for the duration of a ``with`` block (yields whether anything was installed)."""
    done = install(model, mode, chunk_bytes=chunk_bytes, exact=exact)
    try:
        yield done
    finally:
        if done:
            remove(model)


def _fused_by_trl(model: nn.Module) -> bool:
    """TRL's ``add_fused_lm_head`` replaced a forward of ``model`` (or of a module inside it)."""
    for module in model.modules():
        forward = module.__dict__.get("forward")
        code = getattr(getattr(forward, "__func__", None), "__code__", None)
        if code is not None and code.co_name == "_fused_forward":  # functools.wraps renamed the function
            return True
    return False


def _trl_vocab(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    return int(getattr(config, "vocab_size", 32000) or 32000)


def planning_loss(output: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """The loss a planning step of an unchanged script uses: the model's own (``output.loss``, a Hugging
    Face model given labels), else, for a language model's output (``logits`` of the call's
    ``input_ids``' shape plus a vocabulary) the next-token cross-entropy a script computes from them
    (as Hugging Face's loss does: labels shifted, logits viewed), so the plan counts what the
    script's own loss holds; else ``acshim.measure.default_loss``."""
    from .measure import default_loss

    loss = getattr(output, "loss", None)
    logits = getattr(output, "logits", None)
    ids = kwargs.get("input_ids", args[0] if args else None)
    if (not isinstance(loss, torch.Tensor) and isinstance(logits, torch.Tensor) and isinstance(ids, torch.Tensor)
            and logits.dim() == 3 and tuple(logits.shape[:2]) == tuple(ids.shape) and not ids.is_floating_point()
            and logits.requires_grad):
        labels = F.pad(ids, (0, 1), value=-100)[:, 1:].reshape(-1)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels, ignore_index=-100)
    return default_loss(output)
