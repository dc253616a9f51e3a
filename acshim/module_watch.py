"""A global module hook that exists only while some thread watches module calls.

Regions sometimes need to see every module their forward calls (``region_buffers`` records the
buffers of modules a callable reaches only at run time; ``region_escapes`` notes what modules
return). torch's global module hooks slow every module call in the process, so one is registered
while at least one watch is open, anywhere, and removed with the last; each thread's open watches
are its own. Hand-written because torch offers the global hooks but no refcounted, per-thread use.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from torch.utils.hooks import RemovableHandle

Watch = TypeVar("Watch")


class ModuleWatch(Generic[Watch]):
    """``register(hook)`` installs a global module hook (torch's ``register_module_forward_hook`` or
    ``..._pre_hook``); while ``watching(watch)`` bodies are open, the hook calls
    ``visit(watch, *hook_arguments)`` for every watch open on the calling thread."""

    def __init__(self, register: Callable[[Callable[..., None]], RemovableHandle],
                 visit: Callable[..., None]) -> None:
        self._register = register
        self._visit = visit
        self._local = threading.local()
        self._lock = threading.Lock()
        self._open = 0
        self._handle: RemovableHandle | None = None

    def _hook(self, *arguments: Any) -> None:
        for watch in getattr(self._local, "watches", ()):
            self._visit(watch, *arguments)

    @contextlib.contextmanager
    def watching(self, watch: Watch) -> Iterator[Watch]:
        stack = getattr(self._local, "watches", None)
        if stack is None:
            stack = self._local.watches = []
        stack.append(watch)
        with self._lock:
            self._open += 1
            if self._handle is None:
                self._handle = self._register(self._hook)
        try:
            yield watch
        finally:
            stack.remove(watch)
            with self._lock:
                self._open -= 1
                if self._open == 0 and self._handle is not None:
                    self._handle.remove()
                    self._handle = None
