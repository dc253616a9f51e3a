"""What the facades saw that ``acshim run --report`` tells the user: settings that do nothing here.

Engine-level and dialect-free. A facade registers a *check* (``add_check``): given the dialects whose
regions ran, it returns notes such as "cpu_checkpointing is on, but no DeepSpeed checkpoint ran".
A facade that sees a setting only through an upstream entry point (DeepSpeed's ``initialize``)
registers a *watcher*: started by ``watch()`` (when a report starts), it observes that entry point
and returns the function that undoes its patch. The report only reads ``notes``;
``acshim.uninstall()`` calls ``reset()``, which undoes every watcher's patch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection

Check = Callable[[Collection[str]], list[str]]
"""Dialects whose regions ran -> notes on settings that did nothing."""
Watcher = Callable[[], Callable[[], None]]
"""Starts observing; returns the undo."""


class Diagnostics:
    """The facades' checks and watchers (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._checks: dict[str, Check] = {}
        self._watchers: dict[str, Watcher] = {}
        self._undo: dict[str, Callable[[], None]] = {}
        self.watching = False

    def add_check(self, name: str, check: Check) -> None:
        """Register (or replace) the check called ``name``."""
        with self._lock:
            self._checks[name] = check

    def add_watcher(self, name: str, watcher: Watcher) -> None:
        """Register the watcher called ``name``; started at once if ``watch()`` was called."""
        with self._lock:
            self._watchers[name] = watcher
            if self.watching:
                self._start(name)

    def watch(self) -> None:
        """Start every watcher (idempotent)."""
        with self._lock:
            self.watching = True
            for name in self._watchers:
                self._start(name)

    def _start(self, name: str) -> None:
        if name not in self._undo:
            self._undo[name] = self._watchers[name]()

    def notes(self, ran: Collection[str]) -> list[str]:
        """Every check's notes, given the dialects whose regions ran forward."""
        with self._lock:
            checks = list(self._checks.values())
        return [note for check in checks for note in check(ran)]

    def reset(self) -> None:
        """Undo every watcher's patch and stop watching (checks stay registered: they are code)."""
        with self._lock:
            undo, self._undo = list(self._undo.values()), {}
            self.watching = False
        for action in reversed(undo):
            action()


DIAGNOSTICS = Diagnostics()
"""The process's diagnostics (``acshim.uninstall()`` resets it)."""
