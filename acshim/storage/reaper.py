"""Space of dead handles is given back on a thread of its own, never in garbage-collector callbacks.

A Ctrl-C (``KeyboardInterrupt``) is raised in the main thread at the next Python instruction it
runs. During backward that is often a finalizer freeing a saved tensor's slot, and Python swallows
exceptions there ("Exception ignored in: <finalize object>"): the run would go on and the slot stay
allocated. So the weak reference that watches a handle has a C callback (``SimpleQueue.put``) that
runs no Python code; a daemon thread, which signals never interrupt, runs the release. The
interrupt then lands in code that propagates it (an unpack hook, or after backward).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from queue import SimpleQueue
from typing import Any

from ..backends.pinned import install_settle

_log = logging.getLogger(__name__)


class Reaper:
    """Runs ``release(*args)`` on its thread after ``owner`` is garbage collected."""

    def __init__(self) -> None:
        self._queue: SimpleQueue[Any] = SimpleQueue()
        self._pending: dict[weakref.ref[Any], tuple[Callable[..., Any], tuple[Any, ...]]] = {}
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._running = False

    def watch(self, owner: Any, release: Callable[..., Any], *args: Any) -> None:
        """Call ``release(*args)`` once ``owner`` is gone (on the reaper thread)."""
        self._pending[weakref.ref(owner, self._queue.put)] = (release, args)
        if self._thread is None:
            self._start()

    def settle_pending(self) -> bool:
        """``settle()`` if a release is queued or running, else return at once (a cheap check).
        Pinned pools call it before each region they hand out: a step starting right after the
        previous backward then finds every region that backward freed, in the same place."""
        if self._queue.empty() and not self._running:
            return True
        return self.settle()

    def settle(self, timeout: float = 10.0) -> bool:
        """Wait until every release queued so far has run, and those they led to (a tier dies
        with its last slot); False on timeout. For measurements and tests: releases otherwise land
        within moments of the owner's death."""
        if self._thread is None:
            if self._queue.empty():
                return True
            self._start()
        deadline = time.monotonic() + timeout
        while True:
            done = threading.Event()
            self._queue.put(done)
            if not done.wait(max(0.0, deadline - time.monotonic())):
                return False
            if self._queue.empty():
                return True

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is None:
                thread = threading.Thread(target=self._run, name="acshim-release", daemon=True)
                thread.start()
                self._thread = thread

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            self._running = True
            if isinstance(item, threading.Event):
                item.set()
                self._running = False
                continue
            release, args = self._pending.pop(item, (None, ()))
            try:
                if release is not None:
                    release(*args)
            except Exception:  # a failed close must not stop later releases
                _log.exception("acshim offload: releasing a saved tensor's storage failed")
            del item, release, args
            self._running = False

    def _forked(self) -> None:
        self._thread = None  # threads do not survive fork: start again on the next watch
        self._start_lock = threading.Lock()


REAPER = Reaper()
os.register_at_fork(after_in_child=REAPER._forked)
install_settle(REAPER.settle_pending)  # pinned pools let releases of dead graphs land first
