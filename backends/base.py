"""The one interface every transfer engine implements: issue a copy out, issue a copy in, wait, release.

A backend moves the bytes of a saved tensor between where it was computed and a storage tier, without
blocking the caller: ``saved`` notes (at pack time) where the bytes are produced, ``copy_out`` and
``copy_in`` only *issue* work and return a ``Ticket``; ``wait`` blocks until a copy-in has landed
and returns the tensor; ``release`` gives the tier its space back.
The tier (host memory, disk files) is passed in and only needs the small ``Tier`` protocol below, so
backends know nothing of the storage engine above them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


class Tier(Protocol):
    """Where moved bytes live. Called from backend worker threads, so implementations lock."""

    kind: str
    """``"host"`` or ``"disk"``."""

    def write(self, data: torch.Tensor) -> Any:
        """Store a 1-D ``uint8`` CPU tensor; return a slot. Blocking (runs on a worker thread)."""

    def read(self, slot: Any) -> torch.Tensor:
        """The slot's bytes as a 1-D ``uint8`` CPU tensor. Blocking (runs on a worker thread)."""

    def free(self, slot: Any) -> None:
        """Give the slot's space back. The slot is never read again."""


@dataclass(eq=False)
class Ticket:
    """One issued copy. Backends fill the fields they need; callers only pass tickets back."""

    nbytes: int
    device: torch.device
    slot: Any = None
    """The tier's slot once the copy out has landed (or a future of it)."""
    pending: Any = None
    """What ``done``/``wait`` block on: a ``concurrent.futures.Future``, a CUDA event, or None."""
    result: torch.Tensor | None = None
    """For a copy in: the tensor being filled."""
    source: Ticket | None = None
    """For a copy in: the copy-out ticket it reads from."""
    extra: dict[str, Any] = field(default_factory=dict)


class TransferFailed(Exception):
    """A copy out failed; ``data`` is the tensor that was being copied, so nothing computed is lost."""

    def __init__(self, error: OSError, data: torch.Tensor) -> None:
        super().__init__(str(error))
        self.error = error
        self.data = data


class Backend(ABC):
    """A transfer engine for one kind of device. Thread-compatible: the storage engine calls it from
    the thread running forward/backward; the backend's own workers do the copying."""

    def saved(self, data: torch.Tensor) -> Any:
        """Called when autograd saves ``data`` (pack time); what it returns is passed to
        ``copy_out`` as ``ready``, which may be issued later (prefetch > 0 defers it). The CUDA
        backend records an event on the producing stream here; None elsewhere."""
        return None

    @abstractmethod
    def copy_out(self, data: torch.Tensor, tier: Tier, ready: Any = None) -> Ticket:
        """Issue a copy of ``data`` (1-D ``uint8``, on this backend's device) into ``tier``, ordered
        after ``ready`` (from ``saved``).

        The backend keeps ``data`` alive until the copy has read it, then drops it."""

    @abstractmethod
    def copy_in(self, stored: Ticket, tier: Tier) -> Ticket:
        """Issue the copy of a stored tensor back to ``stored.device``; does not block."""

    @abstractmethod
    def done(self, ticket: Ticket) -> bool:
        """True once ``ticket``'s copy has finished (``wait`` would not block). Never raises: a
        failed copy is finished, and ``wait`` raises its error."""

    @abstractmethod
    def wait(self, ticket: Ticket) -> torch.Tensor | None:
        """Block until ``ticket`` has landed; a copy in returns its 1-D ``uint8`` tensor. A failed
        copy out raises ``TransferFailed`` (holding the data, on its device), a failed copy in its
        ``OSError`` (or the ``TransferFailed`` of the copy out it reads)."""

    @abstractmethod
    def release(self, stored: Ticket, tier: Tier) -> None:
        """Free the tier space of a copy-out ticket. Safe to call once, from any thread."""

    def handles(self, data: torch.Tensor) -> bool:
        """True if this backend can move ``data`` (the CUDA backend: memory of its device only, so a
        ``backend=`` override never reaches ``record_stream`` with a CPU tensor)."""
        return True

    def copy_out_can_fail(self, tier: Tier) -> bool:
        """True if a copy out into ``tier`` may fail (then the end of forward waits for them to
        report it); False lets forward end without a host wait (CUDA host tier)."""
        return True

    def kept_used(self, data: torch.Tensor) -> None:  # noqa: B027 - optional hook
        """``data`` (a ``TransferFailed.data``) is used by backward on the current stream."""

    def in_flight_limit(self, tier: Tier, requested: int) -> int | None:
        """The bytes of copies out the session lets wait before forward waits for the oldest
        (``requested``: the tier's or the session's limit); None when the backend bounds them
        itself."""
        return requested

    def close(self) -> None:  # noqa: B027 - optional hook, most backends own nothing to close
        """Stop worker threads (optional)."""
