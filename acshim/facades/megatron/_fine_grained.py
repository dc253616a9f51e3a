"""``TransformerConfig(fine_grained_activation_offloading=True, offload_modules=[...])`` on acshim's
storage tier.

Upstream (megatron/core/pipeline_parallel/fine_grained_activation_offload.py, megatron-core 0.16.1):
each listed module runs inside ``FineGrainedActivationOffloadingInterface(flag, input, name)``; what
autograd saves there (the module's input first of all) is pushed to the current model chunk's
``ChunkOffloadHandler`` and copied to pinned host memory on a CUDA side stream when the group is
committed (``group_commit``, after the bias-dropout-add that still needs the residual), then reloaded
group by group in backward. A chunk exists once ``init_chunk_handler`` ran (``GPTModel.forward``
calls it first); tensors under ``min_offloaded_tensor_size`` elements, or marked
``mark_not_offloadable`` (``tensor.offloading_activation = False``), stay. The manager builds CUDA
streams when created, so upstream fails on a CPU-only machine.

This replacement keeps that interface, the chunk rule, the size floor and the opt-out mark, and puts
each chunk's saved tensors in one storage-tier session (``acshim.storage.BoundaryOffload``): every
offloaded module call is one group, so backward prefetches the groups ahead and the last H stay
resident. The tier is chosen as for ``cpu_offloading``: the engine default (host) or
``ACSHIM_OFFLOAD_STORAGE`` / ``ACSHIM_OFFLOAD_DIR``. Gradients are bitwise unchanged.

Differences: ``group_commit`` returns its tensor unchanged and does not resize
``forced_released_tensors`` to zero (the tier drops its reference once the copy is out; acshim never
frees a storage someone still holds); ``forward_record`` (CUDA-graph capture) raises.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

from acshim.storage.scopes import BoundaryOffload
from acshim.storage.versions import keep

from .._env import offload_storage

DEFAULT_MIN_OFFLOADED_TENSOR_SIZE = 1024 * 1024
"""Upstream's ``init_chunk_handler`` default (elements)."""


class ChunkOffload:
    """One model chunk (upstream ``ChunkOffloadHandler``): a storage-tier session whose groups are the
    offloaded module calls; tensors under ``min_elements`` or marked not offloadable stay put."""

    def __init__(self, min_elements: int) -> None:
        if isinstance(min_elements, bool) or not isinstance(min_elements, int) or min_elements < 0:
            raise ValueError(f"min_offloaded_tensor_size must be a non-negative int (elements), got {min_elements!r}")
        storage, directory = offload_storage()
        self.scope = BoundaryOffload(storage=storage, directory=directory, min_bytes=0)
        self.scope.session.origin = "megatron"
        self.min_elements = min_elements
        self.groups: list[str] = []

    def wanted(self, tensor: torch.Tensor) -> bool:
        """Upstream's ``tensor_need_offloading_checker``."""
        return tensor.numel() >= self.min_elements and getattr(tensor, "offloading_activation", True) is not False

    def _pack(self, tensor: torch.Tensor) -> Any:
        return self.scope.session.pack(tensor) if self.wanted(tensor) else keep(tensor)

    def group(self, name: str) -> saved_tensors_hooks:
        """The hooks of one module call: a new group of this chunk's session."""
        self.groups.append(name)
        self.scope.session.start_group()
        return saved_tensors_hooks(self._pack, self.scope.session.unpack)

    @property
    def moved_bytes(self) -> int:
        """Bytes this chunk sent to the tier."""
        return self.scope.stats.moved_bytes


class _Manager:
    """The process's chunks (upstream: the ``PipelineOffloadManager`` singleton)."""

    def __init__(self) -> None:
        self.current: ChunkOffload | None = None
        self.chunks: list[ChunkOffload] = []  # the last forward's, one per virtual pipeline stage


MANAGER = _Manager()


class FineGrainedActivationOffloadingInterface:
    """Upstream's interface: ``with FineGrainedActivationOffloadingInterface(offload, tensor, name) as
    tensor:`` sends what the module saves inside to the current chunk's tier session when ``offload``
    is true and a chunk was initialised (else nothing happens, as upstream)."""

    def __init__(self, offload: bool, tensor: torch.Tensor, name: str) -> None:
        self.offload = offload
        self.tensor = tensor
        self.name = name
        self._hooks: saved_tensors_hooks | None = None

    def __enter__(self) -> torch.Tensor:
        chunk = MANAGER.current
        if self.offload and chunk is not None:
            self._hooks = chunk.group(self.name)
            self._hooks.__enter__()
        return self.tensor

    def __exit__(self, *exc_info: Any) -> None:
        if self._hooks is not None:
            hooks, self._hooks = self._hooks, None
            hooks.__exit__(*exc_info)

    @staticmethod
    def init_chunk_handler(vp_size: int | None, vp_stage: int | None,
                           min_offloaded_tensor_size: int = DEFAULT_MIN_OFFLOADED_TENSOR_SIZE) -> None:
        """Start a model chunk's forward (``GPTModel.preprocess_for_fine_grained_offloading``)."""
        chunk = ChunkOffload(min_offloaded_tensor_size)
        MANAGER.current = chunk
        MANAGER.chunks = [*MANAGER.chunks, chunk][-(vp_size or 1):]

    @staticmethod
    def get_context(flag: bool) -> Any:
        """A group of the current chunk around a whole block when ``flag`` (upstream: the manager)."""
        if flag and MANAGER.current is not None:
            return MANAGER.current.group("context")
        return contextlib.nullcontext()

    @staticmethod
    def group_commit(tensor: Any, name: str, forced_released_tensors: list[torch.Tensor] | None = None,
                     delay_offload: bool = False) -> Any:
        """The end of a module's group: ``tensor`` unchanged (the tier already has the group)."""
        return tensor

    @staticmethod
    def mark_not_offloadable(tensor: torch.Tensor | None) -> None:
        """Keep ``tensor`` where it is whenever autograd saves it (upstream's attribute)."""
        if tensor is not None:
            tensor.offloading_activation = False

    @staticmethod
    def forward_record(event: Any) -> None:
        raise NotImplementedError(
            "fine_grained_activation_offloading with CUDA-graph capture is not served by acshim; "
            "disable CUDA graphs (cuda_graph_impl='none') or run without acshim")

    @staticmethod
    def reset() -> None:
        """After a step's forward and backward (upstream's schedules): the chunks stay for the next step."""

    @staticmethod
    def reset_instance() -> None:
        """Forget every chunk: nothing is offloaded until ``init_chunk_handler`` runs again."""
        MANAGER.current = None
        MANAGER.chunks = []


def moved_bytes() -> int:
    """Bytes the current step's chunks sent to the tier (tests, reports)."""
    return sum(chunk.moved_bytes for chunk in MANAGER.chunks)
