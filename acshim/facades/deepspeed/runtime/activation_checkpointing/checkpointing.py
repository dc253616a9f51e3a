"""``deepspeed.checkpointing`` (deepspeed/runtime/activation_checkpointing/checkpointing.py, 0.19)
on the acshim engine.

Same names, signatures and defaults as DeepSpeed 0.19; every checkpoint is one engine region
(``checkpoint``: reentrant, ``non_reentrant_checkpoint``: non-reentrant) that restores the CPU,
device and model-parallel tracker RNG streams for the recompute. Module globals
(``PARTITION_ACTIVATIONS``, ``mpu``, ``num_layers``, ...) are live properties over one state object
(``_state.STATE``). ``partition_activations`` runs on the engine's partition scope
(``acshim.partition``): each rank of the mpu's model-parallel group keeps its flat 1/mp_size slice of
every activation argument (in upstream's contiguous buffers when asked, on the host tier with
``cpu_checkpointing``), all-gathered before the recompute; the caller's input is emptied until then,
as upstream. Deliberate differences, each better than upstream:

- no ``deepspeed.init_distributed()`` needed: one process works without torch.distributed;
- reentrant ``checkpoint`` gives parameters gradients even when no input requires grad;
- an emptied ("hollowed") caller tensor gets its full shape back after backward also with one
  model-parallel rank (upstream leaves it flat), nothing is emptied under ``no_grad``, and reusing an
  emptied tensor as a checkpoint input raises a clear RuntimeError;
- the recompute gets exactly the original arguments (upstream adds a ``None`` after each
  non-tensor argument when partitioning), and dict or other non-sequence outputs are returned as
  they are (upstream returns a dict's keys);
- ``cpu_checkpointing`` keeps data correct on a CPU-only machine (upstream corrupts it there);
- ``non_reentrant_checkpoint`` works with ``torch.autograd.grad``.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Callable
from typing import Any

import torch

from acshim import rng as _rng
from acshim.options import RegionOptions
from acshim.partition import HOLLOW_REUSE_ERROR, PartitionedInputs, is_hollow
from acshim.region import run_region
from acshim.state import state as engine_state

from ._profile import FORWARD_GLOBAL_TIMER as FORWARD_GLOBAL_TIMER  # an upstream module name
from ._profile import CheckpointObserver, Timers
from ._state import STATE, StateBackedModule
from .config import activation_checkpointing_config, load_param_dict

__all__ = [
    "CheckpointFunction", "CudaRNGStatesTracker", "checkpoint", "configure", "detach_variable",
    "extract_tensors", "get_cuda_rng_tracker", "get_partition_size", "get_partition_start",
    "is_activation_to_checkpoint", "is_configured", "merge_tensors", "model_parallel_cuda_manual_seed",
    "model_parallel_reconfigure_tp_seed", "non_reentrant_checkpoint", "partition_activations_in_checkpoint",
    "reset", "set_num_layers",
]

logger = logging.getLogger("acshim.facades.deepspeed")

_MODEL_PARALLEL_RNG_TRACKER_NAME = _rng.DEFAULT_STREAM_NAME  # 'model-parallel-rng'


def _global_rank() -> int:
    """``dist.get_rank()`` when torch.distributed is initialised, else 0 (a single process)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


# --------------------------------------------------------------------------------------------------
# RNG tracker and seeding


class CudaRNGStatesTracker(_rng.RNGStatesTracker):
    """Named RNG streams on the accelerator's default generator (the CPU one on a CPU machine).

    Upstream ``CudaRNGStatesTracker`` (Megatron's mpu/random.py): ``reset``, ``get_states``,
    ``set_states``, ``add(name, seed)`` and the ``fork(name='model-parallel-rng')`` context, with the
    same ``Exception`` texts. Built on ``acshim.rng.RNGStatesTracker``, so every checkpoint region
    saves and restores its streams.
    """

    def __init__(self) -> None:
        super().__init__()


def _set_cuda_rng_state(new_state: torch.Tensor, device: int | str | torch.device = -1) -> None:
    """Install ``new_state`` in the accelerator's default generator (upstream: not cloned)."""
    _rng.set_device_rng_state(_rng.default_device_type(), new_state)


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """The module's tracker singleton (``_CUDA_RNG_STATE_TRACKER``)."""
    return STATE._CUDA_RNG_STATE_TRACKER


def _tensor_model_parallel_rank(mpu: Any) -> int:
    """``deepspeed.utils.bwc.bwc_tensor_model_parallel_rank``: 0 without an mpu."""
    if mpu is None:
        return 0
    for method in ("get_tensor_model_parallel_rank", "get_slice_parallel_rank"):
        if hasattr(mpu, method):
            return getattr(mpu, method)()
    return mpu.get_model_parallel_rank()


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the default generator with ``seed`` and the tracker's 'model-parallel-rng' stream with
    ``seed + 2718 + tensor-model-parallel rank`` (after resetting the tracker).

    Difference: without an ``mpu`` upstream fails on rank 0 (AttributeError while logging the data
    parallel rank); here the data parallel rank is then 0.
    """
    mpu = STATE.mpu
    tp_rank = _tensor_model_parallel_rank(mpu)
    model_parallel_seed = seed + 2718 + tp_rank
    if _global_rank() == 0:
        dp_rank = mpu.get_data_parallel_rank() if mpu is not None else 0
        logger.info(
            "> initializing model parallel cuda seeds on global rank %d, model parallel rank %d, and data parallel "
            "rank %d with model parallel seed: %d and data parallel seed: %d",
            _global_rank(), tp_rank, dp_rank, model_parallel_seed, seed)
    tracker = get_cuda_rng_tracker()
    tracker.reset()
    _rng.manual_seed_device(tracker.device_type, seed)
    tracker.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, model_parallel_seed)


def model_parallel_reconfigure_tp_seed(seed: int) -> None:
    """Re-seed only the tracked 'model-parallel-rng' stream with ``seed + 2718 + tp rank``."""
    tp_rank = _tensor_model_parallel_rank(STATE.mpu)
    tracker = get_cuda_rng_tracker()
    with tracker.fork():
        _rng.manual_seed_device(tracker.device_type, seed + 2718 + tp_rank)


# --------------------------------------------------------------------------------------------------
# argument helpers (upstream internals kept for callers that reach them)


def detach_variable(inputs: tuple[Any, ...], device: Any = None) -> tuple[Any, ...]:
    """Detach each tensor of a tuple (optionally moving it to ``device``), keeping requires_grad."""
    if not isinstance(inputs, tuple):
        raise RuntimeError("Only tuple of tensors is supported. Got Unsupported input type: ", type(inputs).__name__)
    out = []
    for item in inputs:
        if isinstance(item, torch.Tensor):
            moved = item.to(device=device) if device is not None else item
            item = moved.detach().requires_grad_(item.requires_grad)
        out.append(item)
    return tuple(out)


def is_activation_to_checkpoint(item: Any) -> bool:
    """A floating-point tensor with at least ``mp_size`` elements and no ``no_checkpointing=True``."""
    return (torch.is_tensor(item) and item.is_floating_point() and item.numel() >= STATE.mp_size
            and not getattr(item, "no_checkpointing", False))


def get_partition_size(item: torch.Tensor) -> int:
    """Elements of ``item`` this model-parallel rank keeps when partitioning."""
    assert item.numel() % STATE.mp_size == 0, \
        "Doesn't handle if partition activation if item is not divisible by mp size"
    return item.numel() // STATE.mp_size


def get_partition_start(item: torch.Tensor) -> int:
    """Flat offset of this rank's partition of ``item``."""
    return item.numel() // STATE.mp_size * STATE.mp_rank


def extract_tensors(all_objects: tuple[Any, ...] | list[Any]) -> tuple[Any, Any, Any]:
    """Split a sequence into (tensors, non-tensors, per-position is-tensor flags), keeping order."""
    tensors = [v for v in all_objects if torch.is_tensor(v)]
    others = [v for v in all_objects if not torch.is_tensor(v)]
    flags = [torch.is_tensor(v) for v in all_objects]
    if type(all_objects) is tuple:
        return tuple(tensors), tuple(others), tuple(flags)
    return tensors, others, flags


def merge_tensors(tensor_objects: Any, non_tensor_objects: Any, tensor_flags: Any) -> tuple[Any, ...]:
    """Inverse of ``extract_tensors``. Difference: upstream mis-merges when partitioning (an extra
    ``None`` after each non-tensor); this always follows the flags."""
    tensors, others = iter(tensor_objects), iter(non_tensor_objects)
    return tuple(next(tensors) if flag else next(others) for flag in tensor_flags)


# --------------------------------------------------------------------------------------------------
# checkpoint


GRAD_ERROR = "Checkpointing is not compatible with .grad(), please use .backward() if possible"

HOST_OFFLOAD_PREFETCH = 1
"""Regions whose inputs stay resident at the end of forward and are fetched ahead in backward:
upstream 0.19's offload engine keeps the last checkpoint's inputs too (``keep_last_count=1``)."""


def _host_offload_scope() -> Any:
    """One engine boundary offload to host memory shared by every checkpoint until ``reset()`` or
    ``configure()`` (upstream's shared ``_cpu_offload_engine``); None without the storage tier.
    On a CPU-only machine the host tier leaves CPU tensors where they are, by design."""
    if STATE._cpu_offload_engine is None:
        try:
            storage = importlib.import_module("acshim.storage")
        except ImportError:
            return None
        factory = getattr(storage, "boundary_offload", None)
        if factory is None:
            return None
        STATE._cpu_offload_engine = factory(storage="host", prefetch=HOST_OFFLOAD_PREFETCH)
    return STATE._cpu_offload_engine


def _region_options(reentrant: bool) -> RegionOptions:
    """The engine options the module's flags ask for (read once, when the forward runs)."""
    observer = None
    if STATE.SYNCHRONIZE or STATE.PROFILE_TIME:
        if STATE.PROFILE_TIME and STATE.timers is None:
            STATE.timers = Timers()
        observer = CheckpointObserver(STATE.SYNCHRONIZE, STATE.timers if STATE.PROFILE_TIME else None, reentrant)
    return RegionOptions(
        reentrant=reentrant,
        preserve_rng_state=True,  # upstream always restores CPU, device and tracker RNG
        grad_error_message=GRAD_ERROR,
        # as upstream, offload only when a backward will run
        saved_tensors_scope=_host_offload_scope() if STATE.CPU_CHECKPOINT and torch.is_grad_enabled() else None,
        observer=observer,
        dialect="deepspeed",
    )


def _contiguous_slots(activations: list[torch.Tensor]) -> list[torch.Tensor]:
    """Upstream's contiguous buffers (``partition_activations`` / ``get_partitioned_activations_for_backward``
    with ``contiguous_checkpoint``): per activation position ``i``, ``num_layers`` flat partition-sized
    buffers (host with ``cpu_checkpointing``) allocated at first use, plus an int64 buffer of shapes;
    each call takes the next slot. More calls than ``num_checkpoints`` before a backward or ``reset()``:
    IndexError, as upstream."""
    data, data_offsets = STATE.contiguous_data_buffers, STATE.data_offsets
    sizes, size_offsets = STATE.contiguous_size_buffers, STATE.size_offsets
    slots = []
    for i, item in enumerate(activations):
        part = item.numel() // STATE.mp_size
        device = torch.device("cpu") if STATE.CPU_CHECKPOINT else item.device
        if i >= len(data):
            data.append(None)
            data_offsets.append(0)
        if data[i] is None:
            data[i] = [torch.empty(part, dtype=item.dtype, device=device) for _ in range(STATE.num_layers)]
            data_offsets[i] = 0
        if data_offsets[i] >= len(data[i]):
            raise IndexError(f"list index out of range: more than num_checkpoints={STATE.num_layers} checkpoints "
                             "before a backward or reset() (contiguous_memory_optimization)")
        slots.append(data[i][data_offsets[i]])
        data_offsets[i] += 1
        shape = torch.tensor(item.shape, dtype=torch.int64)
        if i >= len(sizes):
            sizes.append(None)
            size_offsets.append(0)
        if sizes[i] is None:
            sizes[i] = torch.empty(shape.numel() * STATE.num_layers, dtype=torch.int64)
            size_offsets[i] = 0
        sizes[i].narrow(0, size_offsets[i], shape.numel()).copy_(shape)
        size_offsets[i] += shape.numel()
    return slots


def _drop_contiguous_buffers(namespace: dict[str, Any] | None) -> Callable[[], None]:
    """Upstream's backward start: forget every contiguous buffer list (saved shards keep theirs)."""
    def drop() -> None:
        with STATE.bound_to(namespace):
            if STATE.CONTIGUOUS_CHECKPOINTING:
                STATE.contiguous_data_buffers = []
                STATE.contiguous_size_buffers = []
                STATE.data_offsets = []
                STATE.size_offsets = []

    return drop


def _partitioned_inputs(args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> PartitionedInputs:
    """The engine's partition scope for one call: the activation arguments (``is_activation_to_checkpoint``,
    kwargs values included as 0.19 appends them) kept as this model-parallel rank's 1/mp_size flat
    shard, in a contiguous slot or the host tier (``cpu_checkpointing``) when asked."""
    activations = [item for item in (*args, *(kwargs or {}).values()) if is_activation_to_checkpoint(item)]
    for item in activations:
        get_partition_size(item)  # upstream's AssertionError when numel is not divisible by mp_size
    buffers = _contiguous_slots(activations) if STATE.CONTIGUOUS_CHECKPOINTING else None
    host = _host_offload_scope() if STATE.CPU_CHECKPOINT and buffers is None else None
    return PartitionedInputs(activations, STATE.mp_rank, STATE.mp_size, STATE.mp_group, buffers,
                             session=getattr(host, "session", None),
                             on_backward=_drop_contiguous_buffers(STATE._bound))


def _run(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any] | None,
         reentrant: bool) -> Any:
    for item in (*args, *(kwargs or {}).values()):
        if is_hollow(item):
            raise RuntimeError(HOLLOW_REUSE_ERROR)
    options = _region_options(reentrant)
    observer = options.observer
    partition = None
    if STATE.PARTITION_ACTIVATIONS and torch.is_grad_enabled() and not engine_state.is_checkpointing_disabled:
        partition = _partitioned_inputs(args, kwargs)
        options = options.replace(saved_tensors_scope=partition)
    if observer is not None and not torch.is_grad_enabled():
        # the engine runs a plain call without grad; upstream still times/synchronizes the forward
        observer.forward_start(function)
        output = run_region(function, args, kwargs, options)
        observer.forward_end(function)
        return output
    output = run_region(function, args, kwargs, options)
    if partition is not None:
        partition.hollow()  # upstream's side effect: the caller's inputs are emptied until backward
    return output


def _full_outputs(outputs: Any) -> list[Any] | None:
    """What upstream appends to ``all_outputs``: [tensor], or the items of a tuple/list; None for
    other outputs (dicts, None, ...), which acshim returns unchanged."""
    if torch.is_tensor(outputs):
        return [outputs]
    if isinstance(outputs, (tuple, list)):
        return list(outputs)
    return None


def _as_upstream_output(outputs: Any) -> Any:
    """Upstream's return convention: one item -> that item, several -> a tuple."""
    items = _full_outputs(outputs)
    if items is None:
        return outputs
    return items[0] if len(items) == 1 else tuple(items)


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``function(*args, **kwargs)`` without keeping its activations; recompute in backward.

    Reentrant, as upstream. Outputs: a tensor is returned as is; a tuple or list as a tuple of all
    its items (non-tensors included), a 1-item one unwrapped. Tensor keyword arguments get
    gradients like positional ones (0.19).
    """
    STATE._checkpoint_grad_enabled = torch.is_grad_enabled()
    return _as_upstream_output(_run(function, args, kwargs, reentrant=True))


def non_reentrant_checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """Like ``checkpoint``, recomputing on first use of a saved tensor (saved-tensor hooks).

    Inputs need not require grad; backward twice with ``retain_graph`` works. No keyword arguments
    (as upstream).
    """
    return _as_upstream_output(_run(function, args, None, reentrant=False))


class CheckpointFunction:
    """``CheckpointFunction.apply(run_function, all_outputs, *args)`` as upstream calls it: runs a
    reentrant region, appends the full outputs to the list ``all_outputs`` and returns the tensor
    outputs (the tensor itself for a tensor output, else a tuple).

    Difference: not a ``torch.autograd.Function`` subclass; the engine's reentrant region is.
    """

    @staticmethod
    def apply(run_function: Callable[..., Any], all_outputs: list[Any], *args: Any) -> Any:
        STATE._checkpoint_grad_enabled = torch.is_grad_enabled()
        outputs = _run(run_function, args, None, reentrant=True)
        items = _full_outputs(outputs)
        if items is None:
            all_outputs.append(outputs)
            return outputs
        all_outputs.extend(items)
        return outputs if torch.is_tensor(outputs) else tuple(o for o in items if torch.is_tensor(o))

    @staticmethod
    def forward(ctx: Any, run_function: Callable[..., Any], all_outputs: list[Any], *args: Any) -> Any:
        raise NotImplementedError("call CheckpointFunction.apply(run_function, all_outputs, *args) or checkpoint()")

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise NotImplementedError("CheckpointFunction's backward runs inside the engine's reentrant region")


# --------------------------------------------------------------------------------------------------
# configuration


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    """Set ``PARTITION_ACTIVATIONS`` only (no torch.distributed needed, unlike upstream)."""
    STATE.PARTITION_ACTIVATIONS = partition_activation
    if _global_rank() == 0:
        logger.info("**************Partition Activations %s************", partition_activation)


def set_num_layers(nlayers: int | None) -> None:
    """Set ``num_layers`` (the contiguous-buffer depth) only."""
    STATE.num_layers = nlayers


def reset() -> None:
    """Drop the contiguous-checkpointing bookkeeping (only when contiguous checkpointing is on).

    Also starts a new host-offload session. Flags, mpu, tracker and ``is_configured()`` are untouched,
    as upstream.
    """
    if STATE.CONTIGUOUS_CHECKPOINTING:
        STATE.contiguous_data_buffers = []
        STATE.contiguous_size_buffers = []
        STATE.data_offsets = []
        STATE.size_offsets = []
    STATE._cpu_offload_engine = None  # upstream drains its offload engine; the next forward starts afresh


_SETTING_NAMES = ("PARTITION_ACTIVATIONS", "CONTIGUOUS_CHECKPOINTING", "num_layers", "CPU_CHECKPOINT",
                  "SYNCHRONIZE", "PROFILE_TIME")


def _settings_from_config(config: Any) -> dict[str, Any]:
    block = activation_checkpointing_config(config)
    return {
        "PARTITION_ACTIVATIONS": block.partition_activations,
        "CONTIGUOUS_CHECKPOINTING": block.contiguous_memory_optimization,
        "num_layers": block.number_checkpoints,
        "CPU_CHECKPOINT": block.cpu_checkpointing,
        "SYNCHRONIZE": block.synchronize_checkpoint_boundary,
        "PROFILE_TIME": block.profile,
    }


def _configure_defaults() -> None:
    """Every flag off, ``num_layers`` None, and ``is_configured()`` True from now on."""
    for name in _SETTING_NAMES:
        setattr(STATE, name, None if name == "num_layers" else False)
    STATE.deepspeed_checkpointing_enabled = True


def _configure_using_config_file(config: Any, mpu: Any = None) -> None:
    """Copy the ``activation_checkpointing`` block of ``config`` into the flags."""
    settings = _settings_from_config(config)
    for name, value in settings.items():
        _check_setting(name, value, f"DeepSpeed config activation_checkpointing.{_CONFIG_KEYS[name]}")
    if _global_rank() == 0:
        logger.info("%s", activation_checkpointing_config(config).repr())
    for name, value in settings.items():
        setattr(STATE, name, value)


_ARGUMENTS = ("partition_activations", "contiguous_checkpointing", "num_checkpoints", "checkpoint_in_cpu",
              "synchronize", "profile")
_CONFIG_KEYS = {"PARTITION_ACTIVATIONS": "partition_activations",
                "CONTIGUOUS_CHECKPOINTING": "contiguous_memory_optimization", "num_layers": "number_checkpoints",
                "CPU_CHECKPOINT": "cpu_checkpointing", "SYNCHRONIZE": "synchronize_checkpoint_boundary",
                "PROFILE_TIME": "profile"}


def _check_setting(name: str, value: Any, where: str) -> None:
    """A flag is a bool, ``num_layers`` a whole number >= 0; None means "not given"."""
    if value is None:
        return
    if name == "num_layers":
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{where} must be a whole number of checkpointed layers (or None), got {value!r}")
    elif not isinstance(value, bool):
        raise ValueError(f"{where} must be true or false, got {value!r}")


def configure(
    mpu_: Any,
    deepspeed_config: Any = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """Configure DeepSpeed activation checkpointing.

    Every setting starts from its default, then takes the ``activation_checkpointing`` block of
    ``deepspeed_config`` (a dict, a JSON file path or base64 JSON), then each explicit argument that
    is not None (explicit > JSON > default; an explicit False beats a JSON true). A None ``mpu_``
    keeps the previous mpu; an mpu sets ``mp_rank``/``mp_size``/``mp_group`` from its
    ``get_tensor_model_parallel_*`` (else ``get_model_parallel_*``) methods.

    Differences: no ``init_distributed()`` needed; only the activation-checkpointing block of
    ``deepspeed_config`` is read (no batch-size check); nothing changes when an assert fails.
    """
    settings = {name: (None if name == "num_layers" else False) for name in _SETTING_NAMES}
    if deepspeed_config is not None:
        from_config = _settings_from_config(deepspeed_config)
        if "activation_checkpointing" in load_param_dict(deepspeed_config):
            CONFIG_BLOCKS.append(deepspeed_config if isinstance(deepspeed_config, str) else "a dict")
        for name, value in from_config.items():
            _check_setting(name, value, f"deepspeed_config's activation_checkpointing.{_CONFIG_KEYS[name]}")
        settings.update(from_config)
    explicit = {
        "PARTITION_ACTIVATIONS": partition_activations,
        "CONTIGUOUS_CHECKPOINTING": contiguous_checkpointing,
        "num_layers": num_checkpoints,
        "CPU_CHECKPOINT": checkpoint_in_cpu,
        "SYNCHRONIZE": synchronize,
        "PROFILE_TIME": profile,
    }
    for (name, value), argument in zip(explicit.items(), _ARGUMENTS, strict=True):
        _check_setting(name, value, f"configure: {argument}")
    settings.update({name: value for name, value in explicit.items() if value is not None})
    if settings["CONTIGUOUS_CHECKPOINTING"]:
        assert settings["PARTITION_ACTIVATIONS"], (
            "Contiguous Checkpointing is only available with partitioned activations. Set partitioned "
            "activations to true in deepspeed config")
        assert settings["num_layers"] is not None, \
            "Must specify the number of layers with contiguous memory checkpointing"
    mpu = mpu_ if mpu_ is not None else STATE.mpu
    if mpu is not None:
        if hasattr(mpu, "get_tensor_model_parallel_rank"):
            parallel = (mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size(),
                        mpu.get_tensor_model_parallel_group())
        else:
            parallel = (mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size(),
                        mpu.get_model_parallel_group())
        STATE.mp_rank, STATE.mp_size, STATE.mp_group = parallel
    STATE.mpu = mpu
    for name, value in settings.items():
        setattr(STATE, name, value)
    STATE.deepspeed_checkpointing_enabled = True
    STATE._cpu_offload_engine = None
    if _global_rank() == 0:
        logger.info("Activation Checkpointing Information")
        logger.info("----Partition Activations %s, CPU CHECKPOINTING %s", STATE.PARTITION_ACTIVATIONS,
                    STATE.CPU_CHECKPOINT)
        logger.info("----contiguous Memory Checkpointing %s with %s total layers", STATE.CONTIGUOUS_CHECKPOINTING,
                    STATE.num_layers)
        logger.info("----Synchronization %s", STATE.SYNCHRONIZE)
        logger.info("----Profiling time in checkpointing %s", STATE.PROFILE_TIME)


CONFIG_BLOCKS: list[str] = []
"""Each ``configure(deepspeed_config=...)`` whose config had an ``activation_checkpointing`` block
(the file path, or "a dict"): ``acshim run --report`` flags them when no DeepSpeed checkpoint ran."""


def is_configured() -> bool:
    """True once ``configure`` has been called (never reset), else False."""
    return STATE.deepspeed_checkpointing_enabled


STATE._CUDA_RNG_STATE_TRACKER = CudaRNGStatesTracker()

# The upstream globals become properties over STATE (reads and assignments on this module).
sys.modules[__name__].__class__ = StateBackedModule
