"""Ranks, groups and collectives of SMP v1 for one process (smdistributed.modelparallel.torch.core / comm).

One process is rank 0 of every group and every group has size 1. Process-group getters return
``torch.distributed.group.WORLD`` when torch.distributed is initialised (one rank) and None
otherwise. Barriers and broadcasts have nobody to wait for and return at once; ``allgather`` and
``gather`` return ``[obj]``. Point-to-point ``send`` / ``recv_from`` have no peer and raise.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import torch

from .exceptions import SMPUnsupportedError


class RankType(Enum):
    WORLD_RANK = 0
    PP_RANK = 1
    TP_RANK = 2
    RDP_RANK = 3
    DP_RANK = 4
    MP_RANK = 5

    def get_comm_group(self) -> CommGroup:
        return CommGroup(self.value)


class CommGroup(Enum):
    WORLD = 0
    PP_GROUP = 1
    TP_GROUP = 2
    RDP_GROUP = 3
    DP_GROUP = 4
    MP_GROUP = 5

    def get_rank_type(self) -> RankType:
        return RankType(self.value)


WORLD = CommGroup.WORLD
PP_GROUP = CommGroup.PP_GROUP
TP_GROUP = CommGroup.TP_GROUP
RDP_GROUP = CommGroup.RDP_GROUP
DP_GROUP = CommGroup.DP_GROUP
MP_GROUP = CommGroup.MP_GROUP


def _zero() -> int:
    return 0


def _one() -> int:
    return 1


rank = local_rank = dp_rank = mp_rank = pp_rank = tp_rank = rdp_rank = _zero
size = local_size = dp_size = mp_size = pp_size = tp_size = rdp_size = _one


def _ranks_of_group() -> list[int]:
    return [0]


get_dp_group = get_mp_group = get_pp_group = get_tp_group = get_rdp_group = _ranks_of_group


def _process_group() -> Any:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.group.WORLD
    return None


get_world_process_group = get_dp_process_group = get_mp_process_group = _process_group
get_pp_process_group = get_tp_process_group = get_rdp_process_group = _process_group


def barrier(group: CommGroup = CommGroup.WORLD) -> None:
    """Nobody else to wait for."""


def _no_wait() -> None:
    """Nobody else to wait for."""


dp_barrier = mp_barrier = pp_barrier = tp_barrier = rdp_barrier = _no_wait


def broadcast(obj: Any, group: CommGroup) -> None:
    """Send ``obj`` to the other ranks of ``group``: there are none."""


def allgather(obj: Any, group: CommGroup) -> list[Any]:
    return [obj]


def gather(obj: Any, group: CommGroup, rank: int = 0) -> list[Any]:
    return [obj]


def send(obj: Any, dest_rank: int, rank_type: RankType) -> None:
    raise SMPUnsupportedError(f"smp.send to rank {dest_rank}: a single process has no other rank to send to")


def recv_from(src_rank: int, rank_type: RankType) -> Any:
    raise SMPUnsupportedError(f"smp.recv_from rank {src_rank}: a single process has no other rank to receive from")

__all__ = [
    "RankType", "CommGroup", "WORLD", "PP_GROUP", "TP_GROUP", "RDP_GROUP", "DP_GROUP", "MP_GROUP", "rank",
    "local_rank", "dp_rank", "mp_rank", "pp_rank", "tp_rank", "rdp_rank", "size", "local_size", "dp_size",
    "mp_size", "pp_size", "tp_size", "rdp_size", "get_dp_group", "get_mp_group", "get_pp_group",
    "get_tp_group", "get_rdp_group", "get_world_process_group", "get_dp_process_group",
    "get_mp_process_group", "get_pp_process_group", "get_tp_process_group", "get_rdp_process_group",
    "barrier", "dp_barrier", "mp_barrier", "pp_barrier", "tp_barrier", "rdp_barrier", "broadcast",
    "allgather", "gather", "send", "recv_from",
]
