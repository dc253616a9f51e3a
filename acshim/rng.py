"""Random-number state: named extra RNG streams (the model-parallel tracker) and their capture.

``RNGStatesTracker`` is the device-generic equivalent of Megatron's / DeepSpeed's
``CudaRNGStatesTracker`` (deepspeed/runtime/activation_checkpointing/checkpointing.py): named
generator states that ``fork()`` swaps in and out of the default generator of one device type.
Every tracker is registered, so a checkpointed region saves the states of all of them with the CPU
and device states and restores them for the recompute: dropout inside ``fork()`` draws the same
mask in forward and in recompute.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch

_TRACKERS: weakref.WeakSet[RNGStatesTracker] = weakref.WeakSet()
_streams_seen = False  # set once some tracker holds a stream: until then has_streams() walks nothing

DEFAULT_STREAM_NAME = "model-parallel-rng"


def default_device_type() -> str:
    """The accelerator's device type if one is present, else ``"cpu"``."""
    accelerator = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    return accelerator.type if accelerator is not None else "cpu"


def get_device_rng_state(device_type: str) -> torch.Tensor:
    if device_type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device_type).get_rng_state()


def set_device_rng_state(device_type: str, new_state: torch.Tensor) -> None:
    if device_type == "cpu":
        torch.set_rng_state(new_state)
    else:
        torch.get_device_module(device_type).set_rng_state(new_state)


def manual_seed_device(device_type: str, seed: int) -> None:
    if device_type == "cpu":
        torch.manual_seed(seed)
    else:
        torch.get_device_module(device_type).manual_seed(seed)


class RNGStatesTracker:
    """Named RNG streams on one device type's default generator.

    ``add(name, seed)`` creates a stream; ``with tracker.fork(name):`` runs its body on that stream
    and keeps the advanced state for next time. Error texts follow Megatron/DeepSpeed, whose scripts
    catch them.

    >>> tracker = RNGStatesTracker()
    >>> tracker.add("model-parallel-rng", 1234)
    >>> with tracker.fork():
    ...     mask = torch.rand(4) > 0.5
    """

    def __init__(self, device_type: str | None = None) -> None:
        self.device_type = device_type or default_device_type()
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        _TRACKERS.add(self)

    def reset(self) -> None:
        """Forget every stream and seed."""
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A shallow copy of the name -> generator state mapping."""
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Install a mapping returned by ``get_states`` (stored as given)."""
        self.states_ = states
        if states:
            _saw_streams()

    def add(self, name: str, seed: int) -> None:
        """Create stream ``name`` seeded with ``seed``; both must be new."""
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)  # recorded before the name check, as upstream does
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        _saw_streams()
        outer = get_device_rng_state(self.device_type)
        manual_seed_device(self.device_type, seed)
        self.states_[name] = get_device_rng_state(self.device_type)
        set_device_rng_state(self.device_type, outer)

    @contextlib.contextmanager
    def fork(self, name: str = DEFAULT_STREAM_NAME) -> Iterator[None]:
        """Run the body on stream ``name``, then store its advanced state and restore the outer one."""
        if name not in self.states_:
            raise Exception(f"cuda rng state {name} is not added")
        outer = get_device_rng_state(self.device_type)
        set_device_rng_state(self.device_type, self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = get_device_rng_state(self.device_type)
            set_device_rng_state(self.device_type, outer)


_default_tracker: RNGStatesTracker | None = None


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide default tracker (created on first use)."""
    global _default_tracker
    if _default_tracker is None:
        _default_tracker = RNGStatesTracker()
    return _default_tracker


def has_streams() -> bool:
    """True when some live tracker holds a stream (a region must then restore tracker states)."""
    return _streams_seen and any(tracker.states_ for tracker in list(_TRACKERS))


def _saw_streams() -> None:
    global _streams_seen
    _streams_seen = True


def capture_tracker_states() -> list[tuple[RNGStatesTracker, dict[str, torch.Tensor]]]:
    """Snapshot every live tracker's streams (generator states are immutable once read)."""
    return [(tracker, tracker.get_states()) for tracker in list(_TRACKERS) if tracker.states_]


@contextlib.contextmanager
def restored_tracker_states(
    snapshot: list[tuple[RNGStatesTracker, dict[str, torch.Tensor]]],
) -> Iterator[None]:
    """Install a snapshot for the body (a recompute), then put back what was there before."""
    current = [(tracker, tracker.get_states()) for tracker, _ in snapshot]
    for tracker, states in snapshot:
        tracker.set_states(dict(states))
    try:
        yield
    finally:
        for tracker, states in current:
            tracker.set_states(states)
