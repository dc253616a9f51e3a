"""Per-thread checkpointing state: is a region running its first forward, or recomputing?

Mirrors FairScale's ``ThreadLocalCheckpointingState`` (fairscale/nn/checkpoint/
checkpoint_activations.py): one small thread-local dataclass (``acshim.storage.thread_state``, where
all of acshim's per-thread state lives), and context managers that restore the previous value on
exit so they nest.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .storage.thread_state import THREAD_STATE, ThreadState

_CheckpointingState = ThreadState  # the former name

state = THREAD_STATE
"""This thread's checkpointing flags (the per-thread state object, ``acshim.storage.thread_state``)."""


def is_checkpointing() -> bool:
    """True while a checkpointed region runs its first (forward) pass on this thread."""
    return state.is_checkpointing


def is_recomputing() -> bool:
    """True while a checkpointed region is being recomputed for backward on this thread.

    Use it to skip side effects (counters, running statistics, queue pushes) that must happen once.
    """
    return state.is_recomputing


@contextlib.contextmanager
def temporarily(target: object, name: str, value: object) -> Iterator[None]:
    """Set ``target.name`` to ``value`` for the body and restore the previous value (nests)."""
    previous = getattr(target, name)
    setattr(target, name, value)
    try:
        yield
    finally:
        setattr(target, name, previous)


def _flag(name: str, value: bool) -> contextlib.AbstractContextManager[None]:
    return temporarily(state, name, value)


def disable_checkpointing() -> contextlib.AbstractContextManager[None]:
    """Inside this context every region runs as a plain call: nothing is recomputed."""
    return _flag("is_checkpointing_disabled", True)


def enable_checkpointing() -> contextlib.AbstractContextManager[None]:
    """Mark the current thread as running a region's first forward (restores the old value on exit)."""
    return _flag("is_checkpointing", True)


def enable_recomputing() -> contextlib.AbstractContextManager[None]:
    """Mark the current thread as recomputing a region (restores the old value on exit)."""
    return _flag("is_recomputing", True)
