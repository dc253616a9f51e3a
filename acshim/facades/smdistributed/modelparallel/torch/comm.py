"""Ranks, groups and collectives of SMP v1 (smdistributed.modelparallel.torch.core / comm).

Under a launcher the ranks form ``pipeline_parallel_degree`` (pp) stages times ``world / pp``
data-parallel replicas, laid out as SMP's default ``placement_strategy="cluster"``: the ranks of
one model replica are contiguous, so ``pp_rank = rank % pp`` and ``dp_rank = rank // pp``. The
model-parallel group (MP) is the pipeline group (PP; tensor parallelism is refused, so TP is the
rank alone) and RDP is DP. With pp 1 the data-parallel group is the world. Without
torch.distributed, one process is rank 0 of groups of size 1: barriers return at once,
``allgather`` and ``gather`` return ``[obj]``, and ``send`` / ``recv_from`` have no peer and raise.
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


def _pipeline_degree() -> int:
    """Pipeline stages per model replica: the config's degree under a launcher, else 1."""
    if size() == 1:
        return 1
    from .state_mod import state

    return state.cfg.partitions if state.cfg is not None else 1


def pp_rank() -> int:
    """This rank's pipeline stage (0 .. pp_size() - 1)."""
    return rank() % _pipeline_degree()


def pp_size() -> int:
    """Pipeline stages per model replica (``pipeline_parallel_degree`` under a launcher, else 1)."""
    return _pipeline_degree()


def dp_rank() -> int:
    """Which model replica this rank belongs to."""
    return rank() // _pipeline_degree()


def dp_size() -> int:
    """How many model replicas train on their own data."""
    return size() // _pipeline_degree()


def _zero() -> int:
    return 0


def _one() -> int:
    return 1


rdp_rank, rdp_size, mp_rank, mp_size = dp_rank, dp_size, pp_rank, pp_size
tp_rank, tp_size = _zero, _one


def pipeline_ranks(replica: int | None = None) -> list[int]:
    """Global ranks of the pipeline group of ``replica`` (this rank's by default), by stage."""
    degree = _pipeline_degree()
    base = (dp_rank() if replica is None else replica) * degree
    return list(range(base, base + degree))


def data_parallel_ranks(stage: int | None = None) -> list[int]:
    """Global ranks holding stage ``stage`` (this rank's by default) of every replica."""
    degree = _pipeline_degree()
    stage = pp_rank() if stage is None else stage
    return [replica * degree + stage for replica in range(size() // degree)]


def get_pp_group() -> list[int]:
    return pipeline_ranks()


def get_dp_group() -> list[int]:
    return data_parallel_ranks()


def _own_rank() -> list[int]:
    return [rank()]


get_rdp_group, get_mp_group, get_tp_group = get_dp_group, get_pp_group, _own_rank

_DATA_PARALLEL = (CommGroup.DP_GROUP, CommGroup.RDP_GROUP)
_PIPELINE = (CommGroup.PP_GROUP, CommGroup.MP_GROUP)
_groups: dict[str, Any] = {}


def create_process_groups() -> None:
    """Create this rank's pipeline, data-parallel and one-rank groups (``new_group`` is collective,
    so every rank creates every group in the same order, as torch requires); called by ``smp.init``."""
    _groups.clear()
    if size() == 1:
        return
    degree = _pipeline_degree()
    candidates = ([("own", [each]) for each in range(size())]
                  + [("pp", pipeline_ranks(replica)) for replica in range(size() // degree)]
                  + [("dp", data_parallel_ranks(stage)) for stage in range(degree)])
    for kind, ranks in candidates:
        if len(ranks) == size():
            group = torch.distributed.group.WORLD
        else:
            group = torch.distributed.new_group(ranks)
        if rank() in ranks:
            _groups[kind] = group


def _world_group() -> Any:
    return torch.distributed.group.WORLD if _distributed() else None


def _group(kind: str) -> Any:
    return _groups.get(kind, _world_group()) if size() > 1 else _world_group()


def get_world_process_group() -> Any:
    return _world_group()


def get_dp_process_group() -> Any:
    return _group("dp")


def get_pp_process_group() -> Any:
    return _group("pp")


def get_tp_process_group() -> Any:
    return _group("own")


get_rdp_process_group, get_mp_process_group = get_dp_process_group, get_pp_process_group


def _members(group: CommGroup) -> list[int]:
    """Global ranks of ``group`` as seen from this rank, in group-rank order."""
    group = CommGroup(group)
    if group == CommGroup.WORLD:
        return list(range(size()))
    if group in _DATA_PARALLEL:
        return data_parallel_ranks()
    if group in _PIPELINE:
        return pipeline_ranks()
    return [rank()]


def _process_group(group: CommGroup) -> Any:
    group = CommGroup(group)
    if group in _DATA_PARALLEL:
        return get_dp_process_group()
    if group in _PIPELINE:
        return get_pp_process_group()
    return _world_group()


def _spans_ranks(group: CommGroup) -> bool:
    return size() > 1 and len(_members(group)) > 1


def barrier(group: CommGroup = CommGroup.WORLD) -> None:
    """Wait for the other ranks of ``group`` (a one-rank group returns at once)."""
    if _spans_ranks(group):
        torch.distributed.barrier(group=_process_group(group))


def dp_barrier() -> None:
    barrier(CommGroup.DP_GROUP)


def pp_barrier() -> None:
    barrier(CommGroup.PP_GROUP)


def _no_wait() -> None:
    """Tensor parallelism is refused: the TP group holds this rank only."""


rdp_barrier, mp_barrier, tp_barrier = dp_barrier, pp_barrier, _no_wait


def broadcast(obj: Any, group: CommGroup) -> None:
    """Send ``obj`` to every other rank of ``group``; they take it with ``recv_from(this rank, ...)``."""
    if _spans_ranks(group):
        for other in _members(group):
            if other != rank():
                torch.distributed.send_object_list([obj], dst=other)


def allgather(obj: Any, group: CommGroup) -> list[Any]:
    """``obj`` of every rank of ``group``, in group-rank order."""
    if not _spans_ranks(group):
        return [obj]
    gathered: list[Any] = [None] * len(_members(group))
    torch.distributed.all_gather_object(gathered, obj, group=_process_group(group))
    return gathered


def gather(obj: Any, group: CommGroup, rank: int = 0) -> list[Any] | None:
    """``obj`` of every rank of ``group`` on its group rank ``rank`` (in rank order); None elsewhere."""
    if not _spans_ranks(group):
        return [obj]
    gathered = allgather(obj, group)
    return gathered if _members(group).index(_this_rank()) == rank else None


def _this_rank() -> int:
    return torch.distributed.get_rank() if _distributed() else 0


def _peer(other: int, rank_type: RankType, verb: str) -> int:
    """The global rank of group rank ``other`` in the group of ``rank_type``."""
    if size() == 1:
        raise SMPUnsupportedError(f"smp.{verb} rank {other}: a single process has no other rank to "
                                  f"{'send to' if verb == 'send to' else 'receive from'}")
    members = _members(rank_type.get_comm_group())
    if len(members) == 1:
        raise SMPUnsupportedError(
            f"smp.{verb} rank {other} of {rank_type.name}: that group holds this rank only (tensor parallelism "
            "is not provided); exchange objects over RankType.PP_RANK, DP_RANK or WORLD_RANK")
    if not 0 <= other < len(members) or members[other] == _this_rank():
        raise SMPUnsupportedError(f"smp.{verb}: rank {other} is not another rank of the {len(members)} ranks "
                                  f"of {rank_type.name}")
    return members[other]


def send(obj: Any, dest_rank: int, rank_type: RankType) -> None:
    """Send ``obj`` to ``dest_rank`` of the group of ``rank_type``."""
    torch.distributed.send_object_list([obj], dst=_peer(dest_rank, rank_type, "send to"))


def recv_from(src_rank: int, rank_type: RankType) -> Any:
    """Receive the object ``src_rank`` (a rank of the group of ``rank_type``) sent with ``send`` or ``broadcast``."""
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
