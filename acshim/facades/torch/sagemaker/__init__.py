"""Facade of ``torch.sagemaker`` (SageMaker model parallelism v2) for one process or plain FSDP/DDP.

``import torch.sagemaker as tsm`` becomes ``import acshim.facades.torch.sagemaker as tsm``. SMP v2
adds no checkpointing API of its own: scripts use PyTorch's ``apply_activation_checkpointing`` and
``offload_wrapper`` (served by acshim's ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``
facade). ``init`` validates the config and routes ``sm_activation_offloading`` /
``activation_loading_horizon`` to the engine's storage defaults, which that ``offload_wrapper`` uses.
The real package is closed source and never installed here: ``ACSHIM_PATCHES`` is empty and the
import hook serves this package as the submodule ``torch.sagemaker`` of the real torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

# ``torch`` rather than ``from torch import nn``: importing the submodule ``torch.sagemaker.nn`` rebinds ``nn`` here.
from . import _config, _offload
from . import grad_norm as grad_norm
from ._state import state, world

ACSHIM_PATCHES: list[tuple[str, str, str]] = []


def init(config: str | os.PathLike[str] | Mapping[str, Any] | None = None) -> None:
    """Initialise SMP v2: defaults < ``config`` (dict or JSON file path) < ``SM_HP_MP_PARAMETERS``.

    Raises ``ValueError`` naming the key for a bad value (e.g. ``activation_loading_horizon`` must
    be a positive int; parallel degrees must lie between 1 and the world size).
    """
    _, world_size = world()
    merged = _config.merge(config, world_size)
    state._apply(merged)
    state.offload_status = _offload.route(merged["sm_activation_offloading"], merged["activation_loading_horizon"])
    state.initialized = True


def is_initialized() -> bool:
    """Whether ``init`` has run."""
    return state.initialized


def transform(model: torch.nn.Module, device: Any = None, dtype: Any = None, config: Any = None,
              load_state_dict_from_rank0: bool = False, cp_comm_type: str = "p2p") -> torch.nn.Module:
    """SMP swaps supported Hugging Face models for its tensor/expert/context-parallel implementation.

    With all three degrees 1 (the native fallback, the only case one process can have) there is
    nothing to swap: the same model object is returned, moved to ``device`` / cast to ``dtype`` when
    given. A ``config`` (``MoEConfig``) asks for SMP's expert-parallel MoE implementation, which acshim
    does not provide: ``NotImplementedError``.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"torch.sagemaker.transform takes an torch.nn.Module, got {type(model).__name__}")
    if config is not None:
        raise NotImplementedError(
            "torch.sagemaker.transform(config=MoEConfig(...)) swaps in SMP's expert-parallel MoE implementation, "
            "which acshim does not provide; call transform without config")
    if cp_comm_type not in ("p2p", "all_gather"):
        raise ValueError(f"cp_comm_type must be 'p2p' or 'all_gather', got {cp_comm_type!r}")
    if device is not None or dtype is not None:
        model.to(device=device, dtype=dtype)
    return model


__all__ = ["ACSHIM_PATCHES", "init", "is_initialized", "state", "transform"]
