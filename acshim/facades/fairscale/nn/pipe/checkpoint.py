"""``fairscale.nn.pipe.checkpoint``: Pipe's own per-thread checkpointing flags.

Mirrors fairscale/nn/pipe/checkpoint.py's ``thread_local``, ``enable_checkpointing``,
``enable_recomputing``, ``is_checkpointing`` and ``is_recomputing``: independent of the flags of
``fairscale.nn.checkpoint`` (acshim's engine state), exactly as upstream keeps them apart.
"""

from __future__ import annotations

import contextlib
import threading

from acshim.state import temporarily


class ThreadLocal(threading.local):
    """Pipe's flags: both False on every new thread."""

    def __init__(self) -> None:
        self.is_checkpointing = False
        self.is_recomputing = False


thread_local = ThreadLocal()


def _set(name: str) -> contextlib.AbstractContextManager[None]:
    return temporarily(thread_local, name, True)


def enable_checkpointing() -> contextlib.AbstractContextManager[None]:
    """Make Pipe's ``is_checkpointing()`` True within the context (nests)."""
    return _set("is_checkpointing")


def enable_recomputing() -> contextlib.AbstractContextManager[None]:
    """Make Pipe's ``is_recomputing()`` True within the context (nests)."""
    return _set("is_recomputing")


def is_checkpointing() -> bool:
    """Whether Pipe is running a micro-batch's checkpointed forward on this thread."""
    return thread_local.is_checkpointing


def is_recomputing() -> bool:
    """Whether Pipe is recomputing a micro-batch on this thread."""
    return thread_local.is_recomputing


__all__ = ["is_checkpointing", "is_recomputing"]
