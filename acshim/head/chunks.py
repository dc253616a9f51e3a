"""How the head's rows are cut into chunks, and the per-row kernels every part of ``acshim.head``
shares: the loss value as ``nll_loss`` gives it, the input gradient from torch's two backward kernels,
and the integer checksums that prove a recomputed row equal to the forward's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

MODES = ("loss", "head")


DEFAULT_CHUNK_BYTES = 4 * 2**20
"""Bytes of one chunk's logits (float32 rows of the vocabulary); a chunk's backward holds about four."""


MIN_ROWS = 16
"""Fewest rows per chunk: the BLAS here gives a matmul's rows bitwise only from about 12 rows on."""


REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}


@dataclass
class HeadConfig:
    """How a head's logits are treated: ``mode`` (``loss`` or ``head``), bytes per chunk, exactness of
    a trainable head's weight gradient."""

    mode: str = "head"
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    exact: bool = True
    node: Any = None
    """``head`` mode: the ``HeadProjection`` autograd node that produced the logits (their provenance)."""
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


def loss_value(lp_rows: list[torch.Tensor], target: torch.Tensor, ignore_index: int, reduction: str
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, total_weight)`` exactly as ``nll_loss`` over the whole log-softmax: torch's own kernel
    on each row's value at its target (its sum depends only on the number of rows)."""
    target_class = 1 if ignore_index == 0 else 0
    gathered = torch.cat(lp_rows)
    if target_class:
        gathered = torch.cat([torch.zeros_like(gathered), gathered], dim=1)
    picked = torch.where(target == ignore_index, target, torch.full_like(target, target_class))
    return torch.ops.aten.nll_loss_forward(gathered, picked, None, REDUCTIONS[reduction], ignore_index)


def gather_targets(lp: torch.Tensor, target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    return lp.gather(1, torch.where(target == ignore_index, 0, target).unsqueeze(1))


def logits_grad(grad_out: torch.Tensor, lp: torch.Tensor, target: torch.Tensor, ignore_index: int,
                 reduction: str, total_weight: torch.Tensor) -> torch.Tensor:
    """The gradient of cross-entropy's input rows (torch's two backward kernels, row by row)."""
    grad_lp = torch.ops.aten.nll_loss_backward(grad_out, lp, target, None, REDUCTIONS[reduction], ignore_index,
                                               total_weight)
    return torch._log_softmax_backward_data(grad_lp, lp, 1, lp.dtype)


def rows_grad(grad_out: torch.Tensor, start: int, end: int, reduction: str) -> torch.Tensor:
    return grad_out[start:end] if reduction == "none" else grad_out


@dataclass
class PendingLoss:
    """A fused loss's gradient, handed to its head's backward."""

    rows: torch.Tensor
    target: torch.Tensor
    grad_out: torch.Tensor
    total_weight: torch.Tensor
    checksums: torch.Tensor
    ignore_index: int
    reduction: str
    dtype: torch.dtype


def row_checksums(rows: torch.Tensor) -> torch.Tensor:
    """An integer sum of each row's bits: equal rows give equal sums (order does not matter)."""
    bits = {4: torch.int32, 2: torch.int16, 8: torch.int64}[rows.element_size()]
    return rows.contiguous().view(bits).sum(1, dtype=torch.int64)
