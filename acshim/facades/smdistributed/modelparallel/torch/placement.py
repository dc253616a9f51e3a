"""Partitioning, tensor-parallelism and parameter-initialisation controls of SMP v1, for one partition.

With one pipeline partition every module is on partition 0 and, with ``tensor_parallel_degree``
1, no module is distributed, so these calls only record the request (``smp.partition`` /
``set_partition`` still validate the index) and change nothing, which is what upstream does in that
configuration.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .exceptions import SMPInvalidArgumentError
from .state_mod import state


def _check_partition(index: int) -> None:
    partitions = state.config().partitions
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < partitions:
        raise SMPInvalidArgumentError(f"partition index must be an int in [0, {partitions}), got {index!r}")


@contextlib.contextmanager
def partition(index: int) -> Iterator[None]:
    """Place modules created inside on partition ``index`` (all partitions are this process)."""
    _check_partition(index)
    yield


def set_partition(module: nn.Module, index: int) -> None:
    """Place ``module`` on partition ``index`` (all partitions are this process)."""
    if not isinstance(module, nn.Module):
        raise SMPInvalidArgumentError(f"set_partition takes an nn.Module, got {type(module).__name__}")
    _check_partition(index)


@contextlib.contextmanager
def tensor_parallelism(enabled: bool = True, **tp_config: Any) -> Iterator[None]:
    """Mark supported modules created inside for tensor parallelism: with degree 1 nothing is split."""
    yield


def set_tensor_parallelism(module: nn.Module, enabled: bool = True, **tp_config: Any) -> None:
    """Mark ``module`` for tensor parallelism: with degree 1 nothing is split."""


@contextlib.contextmanager
def delay_param_initialization(enabled: bool = True) -> Iterator[None]:
    """Upstream defers parameter initialisation to partitioning; one partition initialises them now."""
    yield


@contextlib.contextmanager
def model_creation(tensor_parallelism: bool = False, dtype: torch.dtype | None = None,
                   **tensor_parallel_config: Any) -> Iterator[None]:
    """Create the model with default dtype ``dtype`` (restored on exit); tensor parallelism as above."""
    previous = torch.get_default_dtype()
    if dtype is not None:
        torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def is_tracing() -> bool:
    """Upstream traces the model at the first step to partition it; one partition needs no trace."""
    return False

__all__ = ["delay_param_initialization", "is_tracing", "model_creation", "partition", "set_partition", "set_tensor_parallelism", "tensor_parallelism"]
