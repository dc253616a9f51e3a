"""Who wants to know when an offload session starts: ``recording()`` (tests, facades proving a flag
reached the engine) and ``acshim run --report`` (bytes moved per tier, per region).

One small registry object instead of a module-level list that other modules append to:
``add``/``remove`` a callback, ``notify`` every callback of a new session, ``clear`` (done by
``acshim.uninstall()``). Callbacks are called in the order they were added.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

SessionObserver = Callable[[Any], None]
"""Called with each ``OffloadSession`` as it starts."""


class SessionObservers:
    """The callbacks told of every offload session that starts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._callbacks: list[SessionObserver] = []

    def add(self, callback: SessionObserver) -> None:
        """Call ``callback(session)`` for every session started from now on."""
        with self._lock:
            self._callbacks.append(callback)

    def remove(self, callback: SessionObserver) -> None:
        """Stop calling ``callback`` (no error if it was not added, or ``clear`` dropped it)."""
        with self._lock:
            if callback in self._callbacks:
                self._callbacks.remove(callback)

    def notify(self, session: Any) -> None:
        """Tell every callback that ``session`` started."""
        with self._lock:
            callbacks = list(self._callbacks)
        for callback in callbacks:
            callback(session)

    def __contains__(self, callback: object) -> bool:
        with self._lock:
            return callback in self._callbacks

    def clear(self) -> None:
        """Forget every callback."""
        with self._lock:
            self._callbacks.clear()

    def __len__(self) -> int:
        return len(self._callbacks)


SESSION_OBSERVERS = SessionObservers()
"""The process's registry (``acshim.uninstall()`` clears it)."""
