"""acshim's per-thread state, in one place: the engine's checkpointing flags (``acshim.state``
exposes them) and the storage tier's ``no_offload()`` depth.

It sits at the bottom layer (no acshim import) so that every layer reads the same object; the
engine's flags mirror FairScale's ``ThreadLocalCheckpointingState``
(fairscale/nn/checkpoint/checkpoint_activations.py): one small thread-local dataclass.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass
class ThreadState(threading.local):
    """One thread's state (each thread sees its own values, starting at the defaults)."""

    is_checkpointing: bool = False
    is_recomputing: bool = False
    is_checkpointing_disabled: bool = False
    offload_opt_outs: int = 0
    """How many ``acshim.storage.no_offload()`` blocks are open on this thread."""


THREAD_STATE = ThreadState()
"""The process's per-thread state (``acshim.state.state`` is this object)."""
