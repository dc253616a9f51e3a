"""Facade of ``smdistributed.modelparallel.torch`` (SageMaker model parallelism v1, PyTorch).

``import smdistributed.modelparallel.torch as smp`` becomes
``import acshim.facades.smdistributed.modelparallel.torch as smp``. Activation checkpointing
(``smp.patches.checkpoint.checkpoint`` / ``checkpoint_sequential``, ``smp.set_activation_checkpointing``
with each / contiguous / group_N) runs on acshim's engine; ``smp.step`` splits microbatches and
averages their gradients. In one process ``DistributedModel`` is a transparent wrapper (any
pipeline degree runs as one partition); under a launcher with pipeline degree 1 and ``ddp: True``
it runs torch's DistributedDataParallel; with ``pipeline_parallel_degree`` > 1 the model is split
into partitions across ranks and runs on the stage runner (``_pipeline_runner``, which says why it
is not ``torch.distributed.pipelining``). Tensor and sharded data parallelism are refused by name.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from . import amp as amp
from . import comm
from . import nn as nn
from . import patches as patches
from .comm import (
    DP_GROUP,
    MP_GROUP,
    PP_GROUP,
    RDP_GROUP,
    TP_GROUP,
    WORLD,
    CommGroup,
    RankType,
    allgather,
    barrier,
    broadcast,
    dp_barrier,
    dp_rank,
    dp_size,
    gather,
    get_dp_group,
    get_dp_process_group,
    get_mp_group,
    get_mp_process_group,
    get_pp_group,
    get_pp_process_group,
    get_rdp_group,
    get_rdp_process_group,
    get_tp_group,
    get_tp_process_group,
    get_world_process_group,
    local_rank,
    local_size,
    mp_barrier,
    mp_rank,
    mp_size,
    pp_barrier,
    pp_rank,
    pp_size,
    rank,
    rdp_barrier,
    rdp_rank,
    rdp_size,
    recv_from,
    send,
    size,
    tp_barrier,
    tp_rank,
    tp_size,
)
from .config import parse_config
from .exceptions import SMPUnsupportedError
from .model import DistributedModel
from .optimizer import DistributedOptimizer
from .patches.checkpoint import checkpoint, set_activation_checkpointing
from .placement import (
    delay_param_initialization,
    is_tracing,
    model_creation,
    partition,
    set_partition,
    set_tensor_parallelism,
    tensor_parallelism,
)
from .serialization import load, resume_from_checkpoint, save, save_checkpoint
from .state_mod import state
from .step import StepOutput, step


def init(config: Mapping[str, Any] | None = None) -> None:
    """Initialise SMP: config = library defaults < ``config`` < ``SM_HP_MP_PARAMETERS`` (JSON).

    Validates every key as the library does (unknown keys and bad values raise ``ValueError``).
    Calling it again starts over: the config is replaced and the wrapped model is forgotten.
    Under a launcher (``WORLD_SIZE`` above 1) it initialises torch.distributed as upstream does
    (NCCL with CUDA, else gloo) unless the script already did, and every rank is one data-parallel
    replica of the whole model: ``ddp`` must be on, and model-parallel degrees above 1 raise. In
    one process those degrees are accepted with a warning: the model is one unsplit partition.
    """
    cfg = parse_config(config)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 or comm.size() > 1:
        _require_supported_layout(cfg, max(world_size, comm.size()))
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    state.reset_model_state()
    state.cfg = cfg
    if comm.size() > 1:
        comm.create_process_groups()
        return
    for key in _MODEL_PARALLEL_DEGREES:
        if cfg.values[key] > 1:
            warnings.warn(f"smp config {key}={cfg.values[key]}: acshim runs this script in one process, so the "
                          "whole model is one partition with unsplit modules (gradients are unchanged)", stacklevel=2)


_MODEL_PARALLEL_DEGREES = ("pipeline_parallel_degree", "tensor_parallel_degree", "sharded_data_parallel_degree")
_REFUSED_DEGREES = {
    "tensor_parallel_degree": "tensor parallelism (splitting single layers across ranks)",
    "sharded_data_parallel_degree": "sharded data parallelism (SMP's ZeRO-style parameter sharding)",
}


def _require_supported_layout(cfg: Any, world_size: int) -> None:
    """Several ranks: pipeline stages x data-parallel replicas; tensor and sharded data parallelism refused."""
    for key, what in _REFUSED_DEGREES.items():
        if cfg.values[key] > 1:
            raise SMPUnsupportedError(
                f"smp config {key}={cfg.values[key]} with {world_size} processes: acshim does not provide {what}; "
                f"set {key} to 1 and use pipeline_parallel_degree and data parallelism (ddp), with activation "
                "checkpointing for memory")
    stages = cfg.values["pipeline_parallel_degree"]
    if world_size % stages != 0:
        raise SMPUnsupportedError(
            f"smp config pipeline_parallel_degree={stages} with {world_size} processes: the number of processes must "
            "be a multiple of the pipeline degree (each model replica takes pipeline_parallel_degree ranks)")
    if world_size // stages > 1 and not cfg.values["ddp"]:
        raise SMPUnsupportedError(
            f"{world_size} processes with pipeline_parallel_degree={stages} are {world_size // stages} data-parallel "
            "replicas, which SMP runs through DDP: set 'ddp': True in the smp config")


def is_initialized() -> bool:
    """Whether ``smp.init`` has run."""
    return state.initialized


def reset() -> None:
    """Forget the wrapped model and optimizer, so a new ``DistributedModel`` can be created."""
    state.reset_model_state()


def num_microbatches() -> int:
    """The configured number of microbatches."""
    return state.num_microbatches()


__all__ = [
    "init", "is_initialized", "reset", "num_microbatches", "step", "StepOutput", "DistributedModel",
    "DistributedOptimizer", "checkpoint", "set_activation_checkpointing",
    "partition", "set_partition", "tensor_parallelism", "set_tensor_parallelism", "delay_param_initialization",
    "model_creation", "is_tracing", "save", "load", "save_checkpoint", "resume_from_checkpoint",
    "rank", "size", "local_rank", "local_size", "dp_rank", "dp_size", "mp_rank", "mp_size", "pp_rank",
    "pp_size", "tp_rank", "tp_size", "rdp_rank", "rdp_size", "get_dp_group", "get_mp_group", "get_pp_group",
    "get_tp_group", "get_rdp_group", "get_world_process_group", "get_dp_process_group", "get_mp_process_group",
    "get_pp_process_group", "get_tp_process_group", "get_rdp_process_group", "barrier", "dp_barrier",
    "mp_barrier", "pp_barrier", "tp_barrier", "rdp_barrier", "broadcast", "allgather", "gather", "send",
    "recv_from", "CommGroup", "RankType", "WORLD", "MP_GROUP", "DP_GROUP", "PP_GROUP", "TP_GROUP", "RDP_GROUP",
    "state",
]
