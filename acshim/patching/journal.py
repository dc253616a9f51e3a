"""An undo log: every change ``install()`` makes is recorded with the action that reverts it, so
``uninstall()`` (or a failed install) puts back exactly the objects that were there before."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import wrapt

_ABSENT = object()


class PatchWarning(UserWarning):
    """acshim could not apply or undo one patch; the message says which and why."""


@dataclass
class _Change:
    description: str
    undo: Callable[[], None]


@dataclass
class Journal:
    """Changes in the order they were made; ``rollback()`` reverts them newest first."""

    changes: list[_Change] = field(default_factory=list)

    def record(self, description: str, undo: Callable[[], None]) -> None:
        self.changes.append(_Change(description, undo))

    def set_attribute(self, owner: Any, name: str, value: Any) -> None:
        """``setattr(owner, name, value)``, remembering the object found in ``owner``'s own
        ``__dict__`` (a descriptor stays a descriptor) or that there was none."""
        previous = vars(owner).get(name, _ABSENT)
        setattr(owner, name, value)
        self.record(f"{_describe(owner)}.{name}", lambda: _restore(owner, name, previous, value))

    def extend(self, other: Journal) -> None:
        self.changes.extend(other.changes)
        other.changes = []

    def rollback(self) -> list[str]:
        """Undo every change, newest first. Returns the descriptions of undos that failed (each
        also warned); the journal is empty afterwards either way."""
        failures = []
        while self.changes:
            change = self.changes.pop()
            try:
                change.undo()
            except Exception as error:  # keep undoing the rest: a partial undo is the worst outcome
                failures.append(f"{change.description}: {error}")
                warnings.warn(f"acshim: could not undo {change.description}: {error}", PatchWarning, stacklevel=2)
        return failures

    def __len__(self) -> int:
        return len(self.changes)


def _restore(owner: Any, name: str, previous: Any, installed: Any) -> None:
    current = vars(owner).get(name, _ABSENT)
    if current is not installed and isinstance(installed, wrapt.FunctionWrapper):
        # Someone wrapped our wrapper after install (another wrapt user): splice ours out of the
        # chain and leave theirs in place.
        if wrapt.find_wrapper(current, installed) is not None:
            wrapt.unwrap_object(owner, name, installed)
            return
    if current is not installed:
        warnings.warn(
            f"acshim: {_describe(owner)}.{name} was replaced by someone else after acshim patched it; "
            "leaving their object in place", PatchWarning, stacklevel=3)
        return
    if previous is _ABSENT:
        delattr(owner, name)
    else:
        setattr(owner, name, previous)


def _describe(owner: Any) -> str:
    return getattr(owner, "__name__", None) or type(owner).__name__
