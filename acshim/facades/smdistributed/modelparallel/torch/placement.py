"""Partitioning, tensor-parallelism and parameter-initialisation controls of SMP v1.

``smp.partition(i)`` / ``smp.set_partition(module, i)`` record manual pipeline placement, used when
``auto_partition`` is False (see ``_partitioning``): inside ``with smp.partition(i)``, every module
that registers a parameter or is assigned as a child is placed on ``i`` (the innermost context
wins). With automatic partitioning, or one partition, the placement is validated and unused, as
upstream. Tensor parallelism is refused at ``smp.init``, so its markers change nothing.
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


_open_partitions: list[int] = []  # the smp.partition contexts now open, innermost last


def _place_registered_module(module: nn.Module, name: str, child: nn.Module | None) -> None:
    if child is not None and _open_partitions:
        state.placements.setdefault(child, _open_partitions[-1])


def _place_parameter_owner(module: nn.Module, name: str, parameter: nn.Parameter | None) -> None:
    if _open_partitions:
        state.placements.setdefault(module, _open_partitions[-1])


@contextlib.contextmanager
def partition(index: int) -> Iterator[None]:
    """Place modules created inside on partition ``index`` (used when ``auto_partition`` is False)."""
    _check_partition(index)
    registration = nn.modules.module
    handles = [registration.register_module_module_registration_hook(_place_registered_module),
               registration.register_module_parameter_registration_hook(_place_parameter_owner)]
    _open_partitions.append(index)
    try:
        yield
    finally:
        _open_partitions.pop()
        for handle in handles:
            handle.remove()


def set_partition(module: nn.Module, index: int) -> None:
    """Place ``module`` (and its descendants not placed otherwise) on partition ``index``."""
    if not isinstance(module, nn.Module):
        raise SMPInvalidArgumentError(f"set_partition takes an nn.Module, got {type(module).__name__}")
    _check_partition(index)
    state.placements[module] = index


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
