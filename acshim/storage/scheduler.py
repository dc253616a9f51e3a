"""The prefetch schedule: which groups of saved tensors are sent out, and when each comes back.

Saved tensors are grouped in forward order (a group is one checkpointed region's boundary inputs, or
one saved tensor in an ``offload()`` scope); backward visits the groups in reverse. With horizon H:

- forward: the most recent H groups stay resident; a group is sent out when group ``g + H`` starts.
  They are the first ones backward needs, so sending them out would only make backward wait;
- backward: when backward reaches group g, groups ``g-1 … g-H`` are issued to come back, so each
  copy overlaps the compute of the H groups before it, and no group is fetched more than H turns
  before its own. H = 0: everything is sent out at once and fetched only when needed.

Written by hand because torch has no scheduler for saved tensors; unlike torchtune's
``OffloadActivations`` (which starts every copy-in at the moment it is needed), this looks ahead.
The scheduler holds its tensors' handles weakly: autograd owns them.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FetchRecord:
    """A copy-in issued for a tensor of ``group`` while backward was at group ``at_group``."""

    group: int
    at_group: int


class PrefetchScheduler:
    """Groups, the resident window and the prefetch window of one offload scope. Thread-safe."""

    TRACE_LENGTH = 4096
    PRUNE_AT = 256

    def __init__(self, horizon: int) -> None:
        self.horizon = horizon
        self.current = -1
        self._resident: dict[int, list[weakref.ref[Any]]] = {}
        self._stored: dict[int, list[weakref.ref[Any]]] = {}
        self._lock = threading.Lock()
        self.fetches: deque[FetchRecord] = deque(maxlen=self.TRACE_LENGTH)

    def start_group(self) -> list[Any]:
        """Begin the next group; returns the handles now due to be sent out."""
        with self._lock:
            self.current += 1
            if len(self._stored) > self.PRUNE_AT:
                self._prune()
            due_groups = [g for g in self._resident if g <= self.current - self.horizon]
            return self._take(self._resident, due_groups)

    def _prune(self) -> None:
        # Groups of graphs freed without a backward (evaluation with grad on, a failed step) would
        # otherwise stay listed forever in a long-lived (boundary) schedule.
        for group in [g for g, refs in self._stored.items() if all(ref() is None for ref in refs)]:
            del self._stored[group]

    def add(self, handle: Any) -> bool:
        """Put ``handle`` in the current group; True if it must be sent out now (H = 0)."""
        with self._lock:
            handle.group = self.current
            if self.horizon == 0:
                return True
            self._resident.setdefault(self.current, []).append(weakref.ref(handle))
            return False

    def regroup(self, handle: Any, sent_out: bool) -> None:
        """A tensor saved again: it is now needed first at the current group."""
        with self._lock:
            handle.group = self.current
            table = self._stored if sent_out else self._resident
            if sent_out or self.horizon:
                table.setdefault(self.current, []).append(weakref.ref(handle))

    def sent_out(self, handle: Any) -> None:
        """``handle``'s copy out was issued: it is now fetched by the prefetch window."""
        with self._lock:
            self._stored.setdefault(handle.group, []).append(weakref.ref(handle))

    def due_for_fetch(self, group: int) -> list[Any]:
        """Backward reached ``group``: the handles of groups ``group-H … group`` not yet fetched."""
        with self._lock:
            groups = [g for g in self._stored if group - self.horizon <= g <= group]
            handles = self._take(self._stored, groups)
            self.fetches.extend(FetchRecord(handle.group, group) for handle in handles)
            return handles

    def record_fetch(self, handle: Any, at_group: int) -> None:
        """A fetch outside the window (an unexpected order, or a second backward)."""
        self.fetches.append(FetchRecord(handle.group, at_group))

    @staticmethod
    def _take(table: dict[int, list[weakref.ref[Any]]], groups: list[int]) -> list[Any]:
        handles = []
        for g in sorted(groups, reverse=True):
            for ref in table.pop(g):
                handle = ref()
                if handle is not None and handle.group == g:  # a re-saved tensor moves to its later group
                    handles.append(handle)
        return handles
