"""Ranks, groups and collectives of SMP v1 (smdistributed.modelparallel.torch.core / comm).

acshim keeps the whole model on every rank (model-parallel degree 1), so under a launcher the
data-parallel group (DP, RDP) is the world and each model-parallel group (MP, PP, TP) is the rank
alone. Without torch.distributed, one process is rank 0 of groups of size 1: barriers return at
once, ``allgather`` and ``gather`` return ``[obj]``, and ``send`` / ``recv_from`` have no peer and raise.
Collectives go through torch.distributed (gloo or NCCL, whichever the job initialised).
"""

from __future__ import annotations

import os
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


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def rank() -> int:
    """This process's global rank (0 without torch.distributed)."""
    return torch.distributed.get_rank() if _distributed() else 0


def size() -> int:
    """The number of processes (1 without torch.distributed)."""
    return torch.distributed.get_world_size() if _distributed() else 1


def local_rank() -> int:
    """The rank on this node, as the launcher set it (``LOCAL_RANK``)."""
    return int(os.environ.get("LOCAL_RANK", 0)) if _distributed() else 0


def local_size() -> int:
    """The processes on this node, as the launcher set it (``LOCAL_WORLD_SIZE``)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", size())) if _distributed() else 1


def _zero() -> int:
    return 0


def _one() -> int:
    return 1


# Every rank holds the whole model (model-parallel degree 1), so the data-parallel group is the
# world and each model-parallel group is the rank itself.
dp_rank = rdp_rank = rank
dp_size = rdp_size = size
mp_rank = pp_rank = tp_rank = _zero
mp_size = pp_size = tp_size = _one


def _all_ranks() -> list[int]:
    return list(range(size()))


def _own_rank() -> list[int]:
    return [rank()]


get_dp_group = get_rdp_group = _all_ranks
get_mp_group = get_pp_group = get_tp_group = _own_rank

_DATA_PARALLEL = (CommGroup.WORLD, CommGroup.DP_GROUP, CommGroup.RDP_GROUP)
_own_groups: dict[int, Any] = {}


def _create_process_groups() -> None:
    """Create each rank's one-rank model-parallel group (``new_group`` is collective, so every rank
    creates every group, as torch requires); called by ``smp.init``."""
    _own_groups.clear()
    if size() > 1:
        for each in range(size()):
            group = torch.distributed.new_group([each])
            if each == rank():
                _own_groups[each] = group


def _world_group() -> Any:
    return torch.distributed.group.WORLD if _distributed() else None


def _own_group() -> Any:
    return _own_groups.get(rank(), _world_group()) if size() > 1 else _world_group()


get_world_process_group = get_dp_process_group = get_rdp_process_group = _world_group
get_mp_process_group = get_pp_process_group = get_tp_process_group = _own_group


def _spans_ranks(group: CommGroup) -> bool:
    return size() > 1 and CommGroup(group) in _DATA_PARALLEL


def barrier(group: CommGroup = CommGroup.WORLD) -> None:
    """Wait for the other ranks of ``group`` (model-parallel groups hold this rank only)."""
    if _spans_ranks(group):
        torch.distributed.barrier()


def _data_parallel_barrier() -> None:
    if size() > 1:
        torch.distributed.barrier()


def _no_wait() -> None:
    """A model-parallel group holds this rank only: nobody else to wait for."""


dp_barrier = rdp_barrier = _data_parallel_barrier
mp_barrier = pp_barrier = tp_barrier = _no_wait


def broadcast(obj: Any, group: CommGroup) -> None:
    """Send ``obj`` to every other rank of ``group``; they take it with ``recv_from(this rank, ...)``."""
    if _spans_ranks(group):
        for other in range(size()):
            if other != rank():
                torch.distributed.send_object_list([obj], dst=other)


def allgather(obj: Any, group: CommGroup) -> list[Any]:
    """``obj`` of every rank of ``group``, in rank order."""
    if not _spans_ranks(group):
        return [obj]
    gathered: list[Any] = [None] * size()
    torch.distributed.all_gather_object(gathered, obj)
    return gathered


def gather(obj: Any, group: CommGroup, rank: int = 0) -> list[Any] | None:
    """``obj`` of every rank of ``group`` on ``rank`` (in rank order); None on the other ranks."""
    if not _spans_ranks(group):
        return [obj]
    gathered = allgather(obj, group)
    return gathered if _this_rank() == rank else None


def _this_rank() -> int:
    return torch.distributed.get_rank() if _distributed() else 0


def _peer(other: int, rank_type: RankType, verb: str) -> int:
    if size() == 1:
        raise SMPUnsupportedError(f"smp.{verb} rank {other}: a single process has no other rank to "
                                  f"{'send to' if verb == 'send to' else 'receive from'}")
    if rank_type.get_comm_group() not in _DATA_PARALLEL:
        raise SMPUnsupportedError(
            f"smp.{verb} rank {other} of {rank_type.name}: acshim keeps the whole model on each rank, so that "
            "group holds this rank only; exchange objects over RankType.DP_RANK or WORLD_RANK")
    if not 0 <= other < size() or other == _this_rank():
        raise SMPUnsupportedError(f"smp.{verb}: rank {other} is not another rank of {size()}")
    return other


def send(obj: Any, dest_rank: int, rank_type: RankType) -> None:
    """Send ``obj`` to ``dest_rank`` of the group of ``rank_type``."""
    torch.distributed.send_object_list([obj], dst=_peer(dest_rank, rank_type, "send to"))


def recv_from(src_rank: int, rank_type: RankType) -> Any:
    """Receive the object ``src_rank`` sent with ``send`` or ``broadcast``."""
    received: list[Any] = [None]
    torch.distributed.recv_object_list(received, src=_peer(src_rank, rank_type, "recv_from"))
    return received[0]

__all__ = [
    "RankType", "CommGroup", "WORLD", "PP_GROUP", "TP_GROUP", "RDP_GROUP", "DP_GROUP", "MP_GROUP", "rank",
    "local_rank", "dp_rank", "mp_rank", "pp_rank", "tp_rank", "rdp_rank", "size", "local_size", "dp_size",
    "mp_size", "pp_size", "tp_size", "rdp_size", "get_dp_group", "get_mp_group", "get_pp_group",
    "get_tp_group", "get_rdp_group", "get_world_process_group", "get_dp_process_group",
    "get_mp_process_group", "get_pp_process_group", "get_tp_process_group", "get_rdp_process_group",
    "barrier", "dp_barrier", "mp_barrier", "pp_barrier", "tp_barrier", "rdp_barrier", "broadcast",
    "allgather", "gather", "send", "recv_from",
]
