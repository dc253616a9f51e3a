"""``megatron.core.tensor_parallel.random`` (megatron-core 0.16.1): ``checkpoint`` as one reentrant
acshim region, ``CheckpointWithoutOutput`` as an output-discarding region (``acshim.discard``), and
the named RNG streams in acshim's device-generic tracker.

Same names, signatures, stream names, seeds and ``Exception`` texts as upstream. Deliberate
differences:

- every generator state is the accelerator's default generator, or the CPU one on a CPU-only
  machine (upstream reads ``torch.cuda`` unconditionally and fails there);
- ``use_te_rng_tracker`` gets this tracker (upstream falls back to its own when Transformer
  Engine is absent); ``use_cudagraphable_rng=True`` raises (graph-safe generator states are not
  served);
- ``checkpoint(..., distribute_saved_activations=True)`` with more than one tensor-parallel rank
  keeps this rank's 1/TP of the first input on acshim's partition engine (``acshim.partition``) and
  empties the caller's tensor until backward gathers it (upstream leaves the rank's flat chunk in
  it); an input whose size does not split evenly raises ``ValueError`` (upstream truncates and then
  fails to reshape). With one rank the whole input is kept, as upstream's one-chunk split does.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from acshim import rng as _rng
from acshim.discard import DiscardedOutputRegion
from acshim.options import RegionOptions
from acshim.partition import PartitionedInputs
from acshim.region import run_region
from acshim.state import state as engine_state

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
_EXPERT_PARALLEL_RNG_TRACKER_NAME = "expert-parallel-rng"
_DATA_PARALLEL_RNG_TRACKER_NAME = "data-parallel-rng"
_DEFAULT_STATE_NAME = "default-rng"

DIALECT = "megatron"
"""How ``acshim run --report`` names this facade's regions."""

GRAD_ERROR = "Checkpointing is not compatible with .grad(), please use .backward() if possible"

logger = logging.getLogger("acshim.facades.megatron")


def get_expert_parallel_rng_tracker_name() -> str:
    """'expert-parallel-rng'."""
    return _EXPERT_PARALLEL_RNG_TRACKER_NAME


def get_data_parallel_rng_tracker_name() -> str:
    """'data-parallel-rng'."""
    return _DATA_PARALLEL_RNG_TRACKER_NAME


class CudaRNGStatesTracker(_rng.RNGStatesTracker):
    """Upstream ``CudaRNGStatesTracker`` on ``acshim.rng.RNGStatesTracker``: ``is_initialized``,
    ``reset``, ``get_states``, ``set_states``, ``add`` and ``fork`` with upstream's current-stream
    bookkeeping (a nested ``fork`` of the running stream keeps what the inner body drew). Every
    acshim region saves and restores its streams for the recompute."""

    def __init__(self, use_cudagraphable_rng: bool = False, is_inference_rng_tracker: bool = False) -> None:
        if use_cudagraphable_rng:
            raise ValueError("CudaRNGStatesTracker: use_cudagraphable_rng=True (graph-safe generator states) is "
                             "not served by acshim; pass use_cudagraphable_rng=False or run without acshim")
        super().__init__()
        self.use_cudagraphable_rng = False
        self.is_inference_rng_tracker = is_inference_rng_tracker
        self.reset()

    def is_initialized(self) -> bool:
        """True once ``add`` or ``set_states`` ran."""
        return self._is_initialized

    def reset(self) -> None:
        """No streams, no seeds, the default generator current."""
        super().reset()
        self._is_initialized = False
        self._current_state_name = _DEFAULT_STATE_NAME

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        super().set_states(states)

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        super().add(name, seed)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Run the body on stream ``name``; the stream keeps its advanced state."""
        if name not in self.states_:
            raise Exception(f"cuda rng state {name} is not added")
        device = self.device_type
        outer_state = _rng.get_device_rng_state(device)
        outer_name = self._current_state_name
        if outer_name != _DEFAULT_STATE_NAME:
            self.states_[outer_name] = outer_state
        _rng.set_device_rng_state(device, self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            if self._current_state_name != name:
                raise Exception(f"current state name {self._current_state_name} is not the same as the desired "
                                f"state name {name}.")
            self.states_[name] = _rng.get_device_rng_state(device)
            if outer_name != _DEFAULT_STATE_NAME:
                outer_state = self.states_[outer_name]
            _rng.set_device_rng_state(device, outer_state)
            self._current_state_name = outer_name


class _InferenceTracker(CudaRNGStatesTracker):
    """``inference_rng_tracker=True``: ``add``/``set_states`` do nothing, ``fork`` is a null context."""

    def add(self, name: str, seed: int) -> None:
        pass

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        pass

    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Any:  # type: ignore[override]
        return contextlib.nullcontext()


class _TrackerState:
    """The process's tracker (upstream: module globals ``_CUDA_RNG_STATE_TRACKER[_INITIALIZED]``)."""

    tracker: CudaRNGStatesTracker | None = None


_STATE = _TrackerState()


def initialize_rng_tracker(use_te_rng_tracker: bool = False, inference_rng_tracker: bool = False,
                           use_cudagraphable_rng: bool = False, force_reset: bool = False) -> None:
    """Create the process's tracker once (again with ``force_reset``)."""
    if force_reset:
        _STATE.tracker = None
    if _STATE.tracker is not None:
        return
    kind = _InferenceTracker if inference_rng_tracker else CudaRNGStatesTracker
    _STATE.tracker = kind(use_cudagraphable_rng=use_cudagraphable_rng, is_inference_rng_tracker=inference_rng_tracker)


def get_cuda_rng_tracker(use_te_rng_tracker: bool = False, inference_rng_tracker: bool = False,
                         use_cudagraphable_rng: bool = False) -> CudaRNGStatesTracker:
    """The process's tracker, created on first use."""
    initialize_rng_tracker(use_te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng)
    assert _STATE.tracker is not None
    return _STATE.tracker


def get_all_rng_states() -> dict[str, torch.Tensor]:
    """The tracker's name -> generator state mapping (upstream asserts the tracker exists)."""
    assert _STATE.tracker is not None, "Tried getting all rng states but RNG Tracker has not been initalized!"
    return _STATE.tracker.states_


def _parallel_rank(getter: str) -> int:
    """A rank from megatron's ``parallel_state`` when it is the real, initialised one; else 0."""
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    function = getattr(parallel_state, getter, None)
    if function is None:
        return 0
    return function()


def model_parallel_cuda_manual_seed(seed: int, te_rng_tracker: bool = False, inference_rng_tracker: bool = False,
                                    use_cudagraphable_rng: bool = False, tp_rank: int | None = None,
                                    ep_rank: int | None = None, etp_rank: int | None = None,
                                    force_reset_rng: bool = False) -> None:
    """Seed the default generator with ``seed`` and add upstream's three streams: 'data-parallel-rng'
    (``seed``), 'model-parallel-rng' (``seed + 2718 + tp_rank``) and 'expert-parallel-rng'
    (``seed + 1024 + 100 * ep_rank + etp_rank``). Ranks default to megatron's ``parallel_state``."""
    tp_rank = _parallel_rank("get_tensor_model_parallel_rank") if tp_rank is None else tp_rank
    ep_rank = _parallel_rank("get_expert_model_parallel_rank") if ep_rank is None else ep_rank
    etp_rank = _parallel_rank("get_expert_tensor_parallel_rank") if etp_rank is None else etp_rank
    initialize_rng_tracker(te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng, force_reset=force_reset_rng)
    tracker = get_cuda_rng_tracker()
    tracker.reset()
    _rng.manual_seed_device(tracker.device_type, seed)
    tracker.add(_DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(_EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)


def _get_all_rng_states() -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(CPU state, accelerator state, tracker streams): what upstream's recompute restores."""
    device = get_cuda_rng_tracker().device_type
    return torch.get_rng_state(), _rng.get_device_rng_state(device), get_cuda_rng_tracker().get_states()


def _set_all_rng_states(cpu_rng_state: torch.Tensor, cuda_rng_state: torch.Tensor,
                        cuda_rng_state_tracker: dict[str, torch.Tensor]) -> None:
    tracker = get_cuda_rng_tracker()
    torch.set_rng_state(cpu_rng_state)
    _rng.set_device_rng_state(tracker.device_type, cuda_rng_state)
    tracker.set_states(cuda_rng_state_tracker)


@contextlib.contextmanager
def _fork_rng() -> Iterator[None]:
    """Restore every generator state on exit."""
    states = _get_all_rng_states()
    try:
        yield
    finally:
        _set_all_rng_states(*states)


def _tensor_parallel_world_size() -> int:
    return _parallel_rank("get_tensor_model_parallel_world_size") or 1


def _distributed_first_input(args: tuple[Any, ...]) -> PartitionedInputs | None:
    """The engine's partition scope keeping this tensor-parallel rank's 1/TP of ``args[0]`` (upstream:
    ``split_tensor_into_1d_equal_chunks`` in forward, ``gather_split_1d_tensor`` before the
    recompute), or None with one rank (upstream's one-chunk split keeps the whole input)."""
    size = _tensor_parallel_world_size()
    if size == 1 or not torch.is_grad_enabled() or engine_state.is_checkpointing_disabled:
        return None
    first = args[0] if args else None
    if not isinstance(first, torch.Tensor):
        raise TypeError("megatron checkpoint(distribute_saved_activations=True): the first argument must be the "
                        f"tensor to split across tensor-parallel ranks, got {type(first).__name__}")
    if first.numel() % size:
        raise ValueError(f"megatron checkpoint(distribute_saved_activations=True): the first input has "
                         f"{first.numel()} elements, not divisible by the tensor-parallel size {size}; "
                         "set TransformerConfig(distribute_saved_activations=False) or change the shape")
    parallel_state = sys.modules["megatron.core.parallel_state"]
    return PartitionedInputs([first], parallel_state.get_tensor_model_parallel_rank(), size,
                             parallel_state.get_tensor_model_parallel_group())


def checkpoint(function: Callable[..., Any], distribute_saved_activations: bool, *args: Any) -> Any:
    """Recompute ``function(*args)`` in backward (upstream: ``CheckpointFunction``, reentrant), with
    the CPU, accelerator and tracker RNG states of the forward. Raises upstream's RuntimeError when
    ``torch.autograd.grad`` reaches it. ``distribute_saved_activations`` with more than one
    tensor-parallel rank: each rank keeps 1/TP of ``args[0]`` (flat, upstream's layout) and the
    group all-gathers it before the recompute."""
    options = RegionOptions(reentrant=True, preserve_rng_state=True, grad_error_message=GRAD_ERROR, dialect=DIALECT)
    partition = _distributed_first_input(args) if distribute_saved_activations else None
    if partition is None:
        return run_region(function, args, None, options)
    output = run_region(function, args, None, options.replace(saved_tensors_scope=partition))
    partition.hollow()  # upstream replaces the caller's input data by its chunk until backward
    return output


def _in_graph_warmup() -> bool:
    """Megatron's CUDA-graph warmup (``megatron.core.transformer.cuda_graphs.is_graph_warmup``), when
    that module is loaded; upstream skips output discarding then."""
    cuda_graphs = sys.modules.get("megatron.core.transformer.cuda_graphs")
    is_graph_warmup = getattr(cuda_graphs, "is_graph_warmup", None)
    return bool(is_graph_warmup()) if is_graph_warmup is not None else False


class CheckpointWithoutOutput:
    """Upstream ``CheckpointWithoutOutput`` on ``acshim.discard.DiscardedOutputRegion``: ``checkpoint``
    runs ``run_function(*args)`` without keeping its graph; ``discard_output_and_register_recompute``
    frees the output's storage and rebuilds it when ``hook_tensor``'s gradient is computed.

    Differences: ``fp8`` is off for ``False``/``None`` (upstream's ``fp8 is not None`` turns it on for
    ``False`` too and then needs Transformer Engine); a truthy ``fp8`` raises ``ValueError``
    (Transformer Engine's fp8 recompute is not served). A backward that reaches the region before the
    hook ran recomputes there (upstream fails).
    """

    def __init__(self, fp8: Any = False) -> None:
        if fp8 not in (False, None):
            raise ValueError(f"CheckpointWithoutOutput(fp8={fp8!r}): Transformer Engine's fp8 recompute is not "
                             "served by acshim; run without fp8 or without acshim")
        self.fp8 = False
        self._region = DiscardedOutputRegion(DIALECT)

    def checkpoint(self, run_function: Callable[..., Any], *args: Any) -> Any:
        """The call's output; nothing inside ``run_function`` is kept for backward."""
        if _in_graph_warmup():
            return run_function(*args)
        return self._region.run(run_function, *args)

    def discard_output_and_register_recompute(self, hook_tensor: torch.Tensor) -> None:
        """Free the output storages; recompute when ``hook_tensor``'s gradient arrives."""
        if _in_graph_warmup():
            return
        self._region.discard(hook_tensor)


__all__ = [
    "CheckpointWithoutOutput", "CudaRNGStatesTracker", "checkpoint", "get_all_rng_states", "get_cuda_rng_tracker",
    "get_data_parallel_rng_tracker_name", "get_expert_parallel_rng_tracker_name", "initialize_rng_tracker",
    "model_parallel_cuda_manual_seed",
]
