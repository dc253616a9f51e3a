"""Buffers a region's forward changes: the recompute sees them as the forward did, the step changes them once.

A region runs its forward twice: once in forward, once more to recompute in backward. A forward
that updates module state (BatchNorm's running statistics, ``spectral_norm``'s power-iteration
vectors ``u``/``v``, an EMA, a step counter, a buffer reassigned to a new tensor) would update it
twice, and the recompute would compute with the state the forward left behind, not the state the
forward started from (spectral norm's weight then differs: gradients off by up to 9.2 in
issue 16). Nothing here knows a module type; changes are detected:

- just before the region's first forward, every buffer of the region's modules
  (``acshim.region_modules``) is recorded (the object and its version counter) and cloned;
- after it, the buffers whose version moved (changed in place) or whose slot holds another object
  (reassigned, registered, removed) keep their pre-forward clone, and so do buffers whose contents
  differ from the clone (BatchNorm's kernels update the running statistics without bumping their
  version counter; on accelerators the clone is kept without comparing, see ``changes``); the
  other clones are dropped;
- for each recompute, a fresh copy of each kept clone is put into every ``module._buffers`` slot that
  held the buffer (the pre-forward state, as the forward saw it), the recompute runs and changes
  those copies, and then the objects that were in the slots are put back: they hold the forward's
  one update. Nothing is copied into a live buffer after a recompute: the recomputed graph may
  have saved the very tensor it used, and non-reentrant checkpoint does not version-check
  recomputed tensors, so a copy would silently corrupt the backward.

A callable whose modules cannot be found statically is watched while its first forward runs
instead: a global forward pre-hook (registered only then) records each module as it is first
called, cloning its buffers at that moment.

Clones are acshim's own operators, not the region's: they step out of selective checkpointing's
dispatch modes, which cache or replay only the operators the region itself runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack

from .module_watch import ModuleWatch

try:
    from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode

    _SELECTIVE_MODES: tuple[type, ...] = (_CachedTorchDispatchMode, _CachingTorchDispatchMode)
except ImportError:  # a torch without selective checkpointing: no such mode to step out of
    _SELECTIVE_MODES = ()

_MISSING: Any = object()
"""A slot that did not exist (a buffer registered by the forward)."""

Change = tuple[nn.Module, str, Any]
"""(module, buffer name, the slot's pre-forward value: a clone, None or ``_MISSING``)."""


def outside_selective_modes() -> contextlib.AbstractContextManager[Any]:
    """Step out of a selective checkpoint's caching (forward) or replay (recompute) dispatch mode,
    which would record or reject operators the region itself did not run."""
    if _SELECTIVE_MODES and any(isinstance(mode, _SELECTIVE_MODES) for mode in _get_current_dispatch_mode_stack()):
        return _disable_current_modes()
    return contextlib.nullcontext()


class BufferSnapshot:
    """The buffers of some modules just before a forward: objects, versions and clones."""

    __slots__ = ("_modules", "_entries", "_clones")

    def __init__(self) -> None:
        self._modules: list[tuple[nn.Module, frozenset[str]]] = []
        self._entries: list[tuple[nn.Module, str, torch.Tensor | None, int]] = []
        self._clones: dict[int, torch.Tensor] = {}

    def add(self, module: nn.Module) -> None:
        """Record ``module``'s buffers as they are now."""
        buffers = module._buffers
        if not buffers:
            self._modules.append((module, frozenset()))
            return
        self._modules.append((module, frozenset(buffers)))
        fresh = []
        for name, buffer in buffers.items():
            version = -1
            if buffer is not None:
                if buffer.requires_grad:
                    continue  # a tensor of the graph kept as a buffer: not state a recompute may reset
                if not buffer.is_inference():
                    version = buffer._version
                if id(buffer) not in self._clones:
                    fresh.append(buffer)
            self._entries.append((module, name, buffer, version))
        if fresh:
            with outside_selective_modes(), torch.no_grad():
                for buffer in fresh:
                    self._clones[id(buffer)] = buffer.detach().clone()

    def modules(self) -> list[nn.Module]:
        return [module for module, _ in self._modules]

    def changes(self) -> list[Change]:
        """The slots the forward changed, each with its pre-forward value (clones of unchanged
        buffers are dropped)."""
        changed: list[Change] = []
        unversioned: list[tuple[nn.Module, str, torch.Tensor]] = []
        for module, name, before, version in self._entries:
            now = module._buffers.get(name, _MISSING)
            if now is not before or (before is not None and version >= 0 and before._version != version):
                changed.append((module, name, None if before is None else self._clones[id(before)]))
            elif before is not None:
                unversioned.append((module, name, before))
        if unversioned:
            # Some kernels change an argument without bumping its version counter (BatchNorm's
            # running statistics): compare contents. Not on accelerators, where reading the answer
            # would synchronise the device in every forward: there the clone is simply kept and
            # put in place for the recompute (the same values when nothing changed).
            with outside_selective_modes(), torch.no_grad():
                for module, name, before in unversioned:
                    clone = self._clones[id(before)]
                    if clone.device.type != "cpu" or clone.layout != torch.strided or not torch.equal(before, clone):
                        changed.append((module, name, clone))
        for module, names in self._modules:
            buffers = module._buffers
            if buffers and (not names or len(buffers) != len(names) or any(n not in names for n in buffers)):
                changed += [(module, name, _MISSING) for name in buffers if name not in names]
        self._clones.clear()
        return changed


def snapshot(modules: list[nn.Module]) -> BufferSnapshot:
    """The buffers of ``modules`` now (call just before the region's first forward)."""
    taken = BufferSnapshot()
    for module in modules:
        taken.add(module)
    return taken


# --------------------------------------------------------------------------------------------------
# modules found by watching the forward (callables whose modules cannot be found statically)



class _Watcher:
    __slots__ = ("seen", "taken")

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.taken = BufferSnapshot()

    def see(self, module: nn.Module) -> None:
        if id(module) not in self.seen:
            self.seen.add(id(module))
            self.taken.add(module)


_MODULE_CALLS: ModuleWatch[_Watcher] = ModuleWatch(nn.modules.module.register_module_forward_pre_hook,
                                                   lambda watcher, module, args: watcher.see(module))


def watch_modules() -> contextlib.AbstractContextManager[_Watcher]:
    """Record every module called on this thread in the body, with its buffers just before its
    first call (a global forward pre-hook, registered only while some watch is open)."""
    return _MODULE_CALLS.watching(_Watcher())


# --------------------------------------------------------------------------------------------------
# the recompute


@contextlib.contextmanager
def as_the_forward_saw_them(changes: list[Change] | None) -> Iterator[None]:
    """For the body (a recompute), every changed slot holds a fresh copy of its pre-forward value;
    afterwards each slot gets back the object it held before (the forward's one update)."""
    if not changes:
        yield
        return
    previous: list[tuple[nn.Module, str, Any]] = []
    try:
        copies: dict[int, torch.Tensor] = {}
        with outside_selective_modes(), torch.no_grad():
            for module, name, before in changes:
                previous.append((module, name, module._buffers.get(name, _MISSING)))
                if before is _MISSING:
                    module._buffers.pop(name, None)
                    continue
                if before is not None:
                    copy = copies.get(id(before))
                    if copy is None:
                        copy = copies[id(before)] = before.clone()
                    before = copy
                module._buffers[name] = before
        yield
    finally:
        for module, name, value in reversed(previous):
            if value is _MISSING:
                module._buffers.pop(name, None)
            else:
                module._buffers[name] = value


@contextlib.contextmanager
def watching(modules: list[nn.Module]) -> Iterator[BufferSnapshot]:
    """Around a region's first forward: the buffers of ``modules`` before it, or (none known) of
    every module it calls, each just before its first call. ``changes()`` after the body."""
    if modules:
        yield snapshot(modules)
        return
    with watch_modules() as watcher:
        yield watcher.taken
