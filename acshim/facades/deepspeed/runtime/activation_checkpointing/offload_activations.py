"""``deepspeed.runtime.activation_checkpointing.offload_activations`` (DeepSpeed 0.19): offload the
marked inputs of checkpointed layers (Hugging Face ``hidden_states``) during forward, bring them back
for backward.

Upstream (DeepSpeed 0.19 ``offload_activations.py``, after axolotl's checkpoint offload) runs its own
pinned buffer pool and side stream and skips every tensor on a CPU-like accelerator. Here the same
names, arguments, errors and stats run on acshim's storage tier: each marked tensor is one prefetch
group of a ``storage.boundary_offload`` scope whose horizon is ``keep_last_count`` (the newest
``keep_last_count`` stay resident, backward brings that many back ahead). The tier is
``storage.get_defaults().storage`` (``"host"``: device tensors to pinned host memory, CPU tensors
stay put, as upstream skips them) unless the keyword-only ``storage=`` / ``directory=`` or, for an
unchanged script, ``ACSHIM_OFFLOAD_STORAGE`` / ``ACSHIM_OFFLOAD_DIR`` in the environment say otherwise;
``"disk"`` also moves CPU tensors, so CPU training gets the memory relief upstream cannot give.

``use_streams``, ``use_pin_memory``, ``max_fwd_stash_count`` and ``max_cpu_buffer_pool_count`` are
accepted and validated as upstream; the storage backend always copies on a side stream into pinned
memory on CUDA and frees device memory when a copy lands, so they change nothing else. Offloaded
tensors stay valid after the context exits (upstream's backward then raises "no longer tracked").
"""

from __future__ import annotations

import importlib.util
import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

from acshim.storage import boundary_offload
from acshim.storage.layout import movable

from ...._env import offload_storage

__all__ = [
    "CheckpointActivationOffloadStats",
    "CheckpointHiddenStatesOffload",
    "get_checkpoint_hidden_states_offloading_ctx_manager",
    "patch_gradient_checkpointing_layer_marker",
]


@dataclass
class CheckpointActivationOffloadStats:
    """Counters of one context (upstream's fields): reset on each ``__enter__``."""

    saved_tensors_seen: int = 0
    marked_tensors: int = 0
    offloaded_tensors: int = 0
    restored_tensors: int = 0
    skipped_marked_tensors: int = 0
    kept_last_tensors: int = 0
    offloaded_bytes: int = 0
    restored_bytes: int = 0


class _Ref:
    """What autograd keeps for a marked tensor that went to the tier: the tier's handle itself, so
    the slot lives exactly as long as the graph (a table of handles kept every step's slots, and
    their pinned memory, alive until overwritten), and the tensor once restored (a second backward
    reads it again; it is freed with the graph)."""

    __slots__ = ("tensor_id", "handle", "restored", "kept_last")

    def __init__(self, tensor_id: int, handle: Any) -> None:
        self.tensor_id, self.handle = tensor_id, handle
        self.restored: torch.Tensor | None = None
        self.kept_last = False


class _Marker:
    """The process-wide ``GradientCheckpointingLayer.__call__`` patch and the managers using it."""

    lock = threading.Lock()
    local = threading.local()
    wrapper: Any = None
    owned_call: Any = None  # the class's own __call__ before patching; None when inherited
    installed_by_context = False
    users = 0

    @classmethod
    def stack(cls) -> list[CheckpointHiddenStatesOffload]:
        if not hasattr(cls.local, "stack"):
            cls.local.stack = []
        return cls.local.stack


def patch_gradient_checkpointing_layer_marker() -> None:
    """Make every ``transformers.GradientCheckpointingLayer`` call mark its first positional argument
    (``hidden_states``) for the innermost active manager, when the layer is training with gradient
    checkpointing on and grad enabled. Idempotent; managers undo it when the last one exits."""
    if _Marker.wrapper is not None:
        return
    try:
        from transformers import GradientCheckpointingLayer
    except ImportError as error:
        raise RuntimeError("patch_gradient_checkpointing_layer_marker requires the `transformers` package "
                           "(>= 4.52, which introduced GradientCheckpointingLayer). Install it with "
                           "`pip install transformers`.") from error
    original = GradientCheckpointingLayer.__call__

    def marking_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        stack = _Marker.stack()
        manager, marked = (stack[-1] if stack else None), None
        if (manager is not None and self.training and torch.is_grad_enabled()
                and getattr(self, "gradient_checkpointing", False) and args and torch.is_tensor(args[0])):
            marked = args[0]
            manager.mark(marked)
        try:
            return original(self, *args, **kwargs)
        finally:
            if marked is not None:  # a mark the pack hook did not take must not outlive the call
                manager._consume_mark(marked)

    _Marker.owned_call = GradientCheckpointingLayer.__dict__.get("__call__")
    GradientCheckpointingLayer.__call__ = marking_call
    _Marker.wrapper = marking_call


def _unpatch_marker() -> None:
    wrapper, owned = _Marker.wrapper, _Marker.owned_call
    _Marker.wrapper = _Marker.owned_call = None
    if wrapper is None:
        return
    from transformers import GradientCheckpointingLayer

    if GradientCheckpointingLayer.__dict__.get("__call__") is not wrapper:
        return  # someone patched over us: leave theirs
    if owned is None:
        del GradientCheckpointingLayer.__call__
    else:
        GradientCheckpointingLayer.__call__ = owned


class CheckpointHiddenStatesOffload(saved_tensors_hooks):
    """Context manager: tensors saved for backward pass through, except the ones ``mark``-ed (by
    the ``GradientCheckpointingLayer`` patch it installs while active, or by hand), which go to
    acshim's storage tier and come back, bitwise, when backward needs them. Not re-entrant; nest
    separate instances (the innermost gets the marks)."""

    def __init__(self, use_pin_memory: bool = True, use_streams: bool = True, min_offload_bytes: int = 1024,
                 max_fwd_stash_count: int = 2, max_cpu_buffer_pool_count: int = 64, keep_last_count: int = 1,
                 *, storage: str | None = None, directory: str | None = None) -> None:
        for name, value in (("keep_last_count", keep_last_count), ("max_fwd_stash_count", max_fwd_stash_count),
                            ("max_cpu_buffer_pool_count", max_cpu_buffer_pool_count),
                            ("min_offload_bytes", min_offload_bytes)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        self.use_pin_memory, self.use_streams = use_pin_memory, use_streams
        self.min_offload_bytes, self.keep_last_count = min_offload_bytes, keep_last_count
        self.max_fwd_stash_count, self.max_cpu_buffer_pool_count = max_fwd_stash_count, max_cpu_buffer_pool_count
        storage, directory = offload_storage(storage, directory)
        self.scope = boundary_offload(storage, keep_last_count, directory, min_offload_bytes)
        self.storage = self.scope.options.storage
        self.stats = CheckpointActivationOffloadStats()
        self._allowed: dict[int, int] = {}
        self._keep_last: dict[int, tuple[_Ref, int]] = {}
        """The newest ``keep_last_count`` refs of this forward (stay resident) and their bytes."""
        self._next_id = 0
        super().__init__(self._pack_tensor, self._unpack_tensor)

    # ---------------------------------------------------------------------------------- marking

    def mark(self, tensor: torch.Tensor) -> None:
        """Offload ``tensor`` when autograd next saves it inside this context."""
        self._allowed[id(tensor)] = self._allowed.get(id(tensor), 0) + 1
        self.stats.marked_tensors += 1

    def _consume_mark(self, tensor: torch.Tensor) -> bool:
        count = self._allowed.get(id(tensor), 0)
        if count <= 0:
            return False
        if count == 1:
            del self._allowed[id(tensor)]
        else:
            self._allowed[id(tensor)] = count - 1
        return True

    def _offloadable(self, tensor: torch.Tensor) -> bool:
        if not movable(tensor, self.min_offload_bytes) or isinstance(tensor, torch.nn.Parameter):
            return False
        if tensor.numel() > 1 and 0 in tensor.stride():  # an expanded view: its copy would be larger
            return False
        return not (self.storage == "host" and tensor.device.type == "cpu")  # already in host memory

    # ------------------------------------------------------------------------------ pack/unpack

    def _pack_tensor(self, tensor: torch.Tensor) -> Any:
        self.stats.saved_tensors_seen += 1
        if not self._consume_mark(tensor):
            return tensor
        if not self._offloadable(tensor):
            self.stats.skipped_marked_tensors += 1
            return tensor
        self._next_id += 1
        session = self.scope.session
        session.start_group()  # one group per marked tensor: the tier's horizon is keep_last_count
        ref = _Ref(self._next_id, session.pack(tensor))
        ref.kept_last = True
        self._keep_last[self._next_id] = (ref, _nbytes(tensor))
        while len(self._keep_last) > self.keep_last_count:  # the oldest left the resident window
            oldest, nbytes = self._keep_last.pop(next(iter(self._keep_last)))
            oldest.kept_last = False
            self.stats.offloaded_tensors += 1
            self.stats.offloaded_bytes += nbytes
        return ref

    def _unpack_tensor(self, packed: Any) -> Any:
        if not isinstance(packed, _Ref):
            return packed
        if packed.restored is not None:  # retain_graph: a second backward reads the same tensor
            return packed.restored
        tensor = self.scope.session.unpack(packed.handle)
        if packed.kept_last:
            self.stats.kept_last_tensors += 1
        else:
            self.stats.restored_tensors += 1
            self.stats.restored_bytes += _nbytes(tensor)
        packed.restored = tensor
        return tensor

    def _buffer_key(self, tensor: torch.Tensor) -> tuple[Any, ...]:
        """Upstream's host-buffer pool key: dense buffers, so strides do not matter."""
        return tuple(tensor.size()), tensor.dtype, tensor.layout, self.use_pin_memory

    def _empty_cpu_like(self, tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[Any, ...]]:
        """A dense host buffer shaped like ``tensor`` and its key (upstream's helper, kept for code that
        calls it; the storage tier allocates its own). Pinned through DeepSpeed's accelerator API
        when ``use_pin_memory`` and DeepSpeed is installed, as upstream."""
        host = torch.empty(tuple(tensor.size()), dtype=tensor.dtype, layout=tensor.layout, device="cpu")
        if self.use_pin_memory:
            try:
                from deepspeed.accelerator import get_accelerator
            except ImportError:
                if torch.cuda.is_available():
                    host = host.pin_memory()
            else:
                host = get_accelerator().pin_memory(host, make_copy=False)
        return host, self._buffer_key(tensor)

    # ------------------------------------------------------------------------------- lifecycle

    def reset(self) -> None:
        """Fresh stats; forget marks (tensors in flight stay valid: each graph holds its own)."""
        self.stats = CheckpointActivationOffloadStats()
        self._allowed.clear()
        self._keep_last.clear()
        self._next_id = 0

    def __enter__(self) -> CheckpointHiddenStatesOffload:
        if self in _Marker.stack():
            raise RuntimeError("CheckpointHiddenStatesOffload is not re-entrant; use a separate instance for a "
                               "nested context")
        with _Marker.lock:
            if _Marker.wrapper is None and importlib.util.find_spec("transformers") is not None:
                patch_gradient_checkpointing_layer_marker()
                _Marker.installed_by_context = True
            if _Marker.wrapper is not None:
                _Marker.users += 1
        self.reset()
        _Marker.stack().append(self)
        try:
            super().__enter__()
        except BaseException:
            self._leave()
            raise
        return self

    def _leave(self) -> None:
        stack = _Marker.stack()
        if self in stack:
            stack.remove(self)
        with _Marker.lock:
            _Marker.users = max(0, _Marker.users - 1)
            if _Marker.users == 0 and _Marker.installed_by_context:
                _unpatch_marker()
                _Marker.installed_by_context = False

    def __exit__(self, *exc_info: Any) -> None:
        try:
            self._allowed.clear()
            self._keep_last.clear()  # the graph's refs remember whether they stayed resident
            if exc_info[0] is None:
                self.scope.session.forward_end()  # copies out landed; a failed write raises here
        finally:
            try:
                self._leave()
            finally:
                super().__exit__(*exc_info)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.element_size() * tensor.nelement()


def get_checkpoint_hidden_states_offloading_ctx_manager(
        use_pin_memory: bool = True, use_streams: bool = True, min_offload_bytes: int = 1024,
        max_fwd_stash_count: int = 2, max_cpu_buffer_pool_count: int = 64, keep_last_count: int = 1,
        *, storage: str | None = None, directory: str | None = None) -> CheckpointHiddenStatesOffload:
    """A new ``CheckpointHiddenStatesOffload`` with these options (upstream's factory)."""
    return CheckpointHiddenStatesOffload(use_pin_memory, use_streams, min_offload_bytes, max_fwd_stash_count,
                                         max_cpu_buffer_pool_count, keep_last_count, storage=storage,
                                         directory=directory)
