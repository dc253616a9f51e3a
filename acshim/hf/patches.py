"""Exact, undoable attribute replacement on classes and modules.

Written by hand instead of with wrapt: transformers 5.x decides whether a subclass overrides
``gradient_checkpointing_enable`` by identity (``getattr(self, name).__func__ is not
getattr(PreTrainedModel, name)``); a wrapt ``FunctionWrapper`` returns a fresh bound wrapper on
every class access, so that test would always say "overridden" and the two entry points would call
each other forever. A plain function stored in the class ``__dict__`` keeps the identity test true.
"""

from __future__ import annotations

from typing import Any

_ABSENT = object()


class AttributePatch:
    """Replace ``owner.<name>`` with ``replacement``; ``restore()`` puts back exactly what the
    owner's own ``__dict__`` held (or removes the attribute if it held nothing)."""

    def __init__(self, owner: Any, name: str, replacement: Any) -> None:
        self.owner, self.name, self.replacement = owner, name, replacement
        self.original: Any = _ABSENT
        self.applied = False

    def apply(self) -> None:
        self.original = vars(self.owner).get(self.name, _ABSENT)
        setattr(self.owner, self.name, self.replacement)
        self.applied = True

    def restore(self) -> None:
        if not self.applied:
            return
        if self.original is _ABSENT:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.original)
        self.applied = False


class PatchSet:
    """Patches applied all together or not at all, restored in reverse order."""

    def __init__(self) -> None:
        self.patches: list[AttributePatch] = []

    def apply(self, patches: list[AttributePatch]) -> None:
        done: list[AttributePatch] = []
        try:
            for patch in patches:
                patch.apply()
                done.append(patch)
        except BaseException:
            for patch in reversed(done):
                patch.restore()
            raise
        self.patches.extend(done)

    def restore(self) -> None:
        while self.patches:
            self.patches.pop().restore()

    def __bool__(self) -> bool:
        return bool(self.patches)
