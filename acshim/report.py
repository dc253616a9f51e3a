"""``acshim run --report``: is checkpointing working? Per region and per dialect, what ran, and the
settings that silently do nothing.

A ``RegionRecorder`` set as ``acshim.region.STATS.recorder`` sees every region call
(``call``: which API made it, the input bytes it keeps for the recompute, ``use_cache``, nesting) and
the engine's forwards and recomputes; it observes every offload session of the storage tier
(``acshim.storage.observers``: bytes moved per tier, prefetch hits and waits). The settings that do
nothing come from what the facades told ``acshim.diagnostics``, and each region's API from what its
facade named (``acshim.region_dialect``): this module knows no dialect.
``start()`` hands back the recorder, whose ``render`` the CLI gives ``acshim.patching.runner`` to
print at exit; ``stop()`` (and ``acshim.uninstall()``) undoes what ``start()`` did.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from . import structures
from .diagnostics import DIAGNOSTICS
from .region_dialect import ENGINE
from .state import state


@dataclass
class RegionEntry:
    """One region (a module, or one function's code) and what it did."""

    name: str
    dialect: str
    forwards: int = 0
    recomputes: int = 0
    held: int = 0
    """Bytes of the input tensors the region keeps for its recompute (largest call)."""
    nested_in: str | None = None


@dataclass
class RegionRecorder:
    """Collects what ``render`` reports (see the module docstring)."""

    entries: dict[Any, RegionEntry] = field(default_factory=dict)
    offloads: list[tuple[Any, str]] = field(default_factory=list)
    """Each offload session the storage tier started, with the region it was attributed to."""
    use_cache: list[str] = field(default_factory=list)
    current: RegionEntry | None = None
    paused: bool = False
    """Set while ``--budget`` plans: its profiling runs are not the script's."""
    _class_counts: dict[str, int] = field(default_factory=dict)

    # ---------------------------------------------------------------------------------- events
    def call(self, function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], options: Any) -> None:
        entry = self._entry(function, create=True, dialect=getattr(options, "dialect", None))
        assert entry is not None
        self.current = entry
        entry.held = max(entry.held, _input_bytes(args, kwargs))
        if _asks_for_cache(function, kwargs) and entry.name not in self.use_cache:
            self.use_cache.append(entry.name)
        if state.is_checkpointing and not state.is_recomputing and entry.nested_in is None:
            outer = _outer_region(function)
            outer_entry = self._entry(outer, create=False) if outer is not None else None
            entry.nested_in = outer_entry.name if outer_entry is not None else "another region"

    def forward(self, function: Callable[..., Any]) -> None:
        entry = self._entry(function, create=True)
        if entry is not None:
            entry.forwards += 1

    def recompute(self, function: Callable[..., Any]) -> None:
        entry = self._entry(function, create=True)
        if entry is not None:
            entry.recomputes += 1

    @property
    def sessions(self) -> list[tuple[Any, str]]:
        """Former name of ``offloads``."""
        return self.offloads

    def offload_started(self, session: Any) -> None:
        """An offload session started: attributed to the current region."""
        if self.paused:
            return
        self.offloads.append((session, self.current.name if self.current is not None else "(outside regions)"))

    session_started = offload_started

    def _entry(self, function: Callable[..., Any], *, create: bool, dialect: str | None = None) -> RegionEntry | None:
        owner, key = _identity(function)
        entry = self.entries.get(key)
        if entry is None and create:
            # the block's class and its index among the regions of that class, whichever API made
            # the region (a dialect's wrapper, a Hugging Face switch, --hf, a closure around the block)
            label = type(owner).__name__ if owner is not None else _short_qualname(_unwrapped(function))
            count = self._class_counts.get(label, 0)
            self._class_counts[label] = count + 1
            # a facade that made the region marks its module (acshim_dialect) or names itself in the
            # region's options (RegionOptions.dialect, see acshim.region_dialect); else the engine's API
            dialect = getattr(owner, "acshim_dialect", None) or dialect or ENGINE
            entry = self.entries[key] = RegionEntry(f"{label}#{count}", dialect)
        return entry

    # ---------------------------------------------------------------------------------- output
    def warnings(self) -> list[str]:
        """Settings that silently do nothing."""
        out = []
        ran = {entry.dialect for entry in self.entries.values() if entry.forwards}
        out = DIAGNOSTICS.notes(ran)  # what the facades saw: settings of a dialect that did not run
        for entry in self.entries.values():
            if entry.nested_in is not None:
                out.append(f"checkpointing requested twice: region {entry.name} ({entry.dialect}) runs inside region "
                           f"{entry.nested_in}; its block is recomputed twice in backward (checkpoint it once)")
        if self.use_cache:
            out.append(f"use_cache=True during checkpointed training (regions {', '.join(self.use_cache[:3])}): the "
                       "cache is dropped in every region and only costs memory; set model.config.use_cache = False")
        return out

    def render(self) -> str:
        rows = ["acshim report: regions",
                f"  {'region':<28} {'dialect':<26} {'forwards':>8} {'recomputes':>10} {'held (inputs)':>14}"]
        for entry in self.entries.values():
            rows.append(f"  {entry.name:<28} {entry.dialect:<26} {entry.forwards:>8} {entry.recomputes:>10} "
                        f"{_mib(entry.held):>14}")
        if not self.entries:
            rows.append("  (no region ran)")
        from .compiled import compiled_graphs

        if compiled_graphs():
            rows.append("  (torch.compile ran: regions inside compiled graphs run as torch's checkpoint operator, "
                        "recomputed by the compiled backward, and are not counted here)")
        per_dialect: dict[str, list[int]] = {}
        for entry in self.entries.values():
            totals = per_dialect.setdefault(entry.dialect, [0, 0, 0, 0])
            totals[0] += 1
            totals[1] += entry.forwards
            totals[2] += entry.recomputes
            totals[3] += entry.held
        rows.append("acshim report: per dialect")
        for dialect, (regions, forwards, recomputes, held) in per_dialect.items():
            rows.append(f"  {dialect:<26} {regions} region(s), {forwards} forwards, {recomputes} recomputes, "
                        f"inputs held {_mib(held)} per step")
        tiers: dict[tuple[str, str], list[float]] = {}
        for session, _ in self.offloads:
            stats = session.stats
            totals = tiers.setdefault((stats.storage, getattr(session, "origin", "acshim")), [0, 0, 0, 0.0])
            totals[0] += stats.moved_bytes
            totals[1] += stats.fetched - stats.late
            totals[2] += stats.late
            totals[3] += stats.wait_seconds
        rows.append("acshim report: offloaded")
        for (tier, origin), (moved, hits, waits, seconds) in tiers.items():
            rows.append(f"  {tier:<6} {_mib(moved)} moved, prefetch hits {int(hits)}, waits {int(waits)} "
                        f"({seconds * 1e3:.1f} ms), by {origin}")
        if not tiers:
            rows.append("  nothing (no storage tier was used)")
        notes = self.warnings()
        rows.append("acshim report: settings that do nothing" + ("" if notes else ": none found"))
        rows += [f"  - {note}" for note in notes]
        return "\n".join(rows)


def start() -> RegionRecorder:
    """Install a recorder (idempotent) and return it, hooked up to the storage tier's session
    observers and with the facades' diagnostics watchers (``Dialect.diagnostics``) started; after
    ``acshim.uninstall()`` (which undoes those two) a second call hooks the same recorder up again."""
    from .patching.dialects import DIALECTS
    from .region import STATS
    from .storage.observers import SESSION_OBSERVERS

    if STATS.recorder is None:
        STATS.recorder = RegionRecorder()
    if STATS.recorder.offload_started not in SESSION_OBSERVERS:
        SESSION_OBSERVERS.add(STATS.recorder.offload_started)
    for dialect in DIALECTS:
        if dialect.diagnostics is not None:
            importlib.import_module(dialect.diagnostics)
    DIAGNOSTICS.watch()
    return STATS.recorder


def stop() -> None:
    """Undo ``start()``: no recorder, no observer, every diagnostics watcher's patch undone."""
    from .region import STATS
    from .storage.observers import SESSION_OBSERVERS

    recorder, STATS.recorder = STATS.recorder, None
    if recorder is not None:
        SESSION_OBSERVERS.remove(recorder.offload_started)
    DIAGNOSTICS.reset()


def _mib(size: float) -> str:
    return f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 2**10:.1f} KiB"


def _unwrapped(function: Any) -> Any:
    while hasattr(function, "func") and hasattr(function, "keywords"):
        function = function.func
    return function


def _identity(function: Callable[..., Any]) -> tuple[torch.nn.Module | None, Any]:
    """The module a region runs (None for a plain function) and the key of its row: one row per
    module; for a closure (DeepSpeed's ``custom(module)`` idiom, a group of layers) one row per code
    and the modules and indexes it captured, so each block's closure is its own region."""
    from .region import owning_module

    owner = owning_module(function)
    if owner is not None:
        return owner, ("module", id(owner))
    inner = _unwrapped(function)
    code = getattr(inner, "__code__", None) or id(inner)
    modules, indexes = _captured(function)
    # a container is keyed by what it holds: checkpoint_sequential's segments capture a ModuleList
    # sliced anew each step (model.h[2:]), whose blocks are the same
    members = tuple(id(module) for module in _contents(modules))
    if len(modules) == 1:
        return modules[0], ("closure", code, members, indexes)
    return None, ("code", code, members, indexes)


def _contents(modules: list[torch.nn.Module]) -> list[torch.nn.Module]:
    out = []
    for module in modules:
        if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)):
            out += _contents(list(module.children()))
        else:
            out.append(module)
    return out


def _captured(function: Callable[..., Any]) -> tuple[list[torch.nn.Module], tuple[int, ...]]:
    """The modules (also inside a list or tuple) and the integers a callable carries: a partial's
    arguments, a closure's cells and a function's defaults, in order, modules once each."""
    values: list[Any] = []
    while hasattr(function, "func") and hasattr(function, "keywords"):
        values += [*function.args, *function.keywords.values()]
        function = function.func
    values += [cell.cell_contents for cell in getattr(function, "__closure__", None) or ()
               if _cell_filled(cell)]
    values += list(getattr(function, "__defaults__", None) or ())
    modules: dict[int, torch.nn.Module] = {}
    indexes: list[int] = []
    for value in values:
        items = value if isinstance(value, (list, tuple)) else (value,)
        for item in items:
            if isinstance(item, torch.nn.Module):
                modules.setdefault(id(item), item)
            elif isinstance(item, int) and not isinstance(item, bool) and item is value:
                indexes.append(item)
    return list(modules.values()), tuple(indexes)


def _cell_filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:  # a cell not yet assigned
        return False
    return True


def _input_bytes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    seen, total = set(), 0
    for leaf in structures.flatten((args, kwargs))[0]:
        if isinstance(leaf, torch.Tensor) and not isinstance(leaf, torch.nn.Parameter) \
                and leaf.layout == torch.strided and leaf.device.type != "meta":
            storage = leaf.untyped_storage()
            if storage._cdata not in seen:
                seen.add(storage._cdata)
                total += storage.nbytes()
    return total


def _asks_for_cache(function: Any, kwargs: dict[str, Any]) -> bool:
    if kwargs.get("use_cache") is True:
        return True
    while hasattr(function, "func") and hasattr(function, "keywords"):
        if function.keywords.get("use_cache") is True:
            return True
        function = function.func
    return False


def _outer_region(function: Callable[..., Any]) -> Callable[..., Any] | None:
    """The callable of the region whose forward is running further up the stack."""
    from .region import ReentrantSpec
    from .region_call import RegionCall

    codes = {RegionCall.__call__.__code__: "self", ReentrantSpec.run_forward.__code__: "self"}
    frame: types.FrameType | None = sys._getframe(2)
    while frame is not None:
        slot = codes.get(frame.f_code)
        if slot is not None:
            holder = frame.f_locals.get(slot)
            outer = getattr(holder, "function", None)
            if outer is not None and outer is not function:
                return outer
        frame = frame.f_back
    return None


def _short_qualname(function: Callable[..., Any]) -> str:
    """``outer.<locals>.inner.<locals>.forward`` -> ``outer.forward``: fits the table's column."""
    parts = [p for p in getattr(function, "__qualname__", "fn").split(".") if p != "<locals>"]
    return ".".join(parts[:1] + parts[-1:]) if len(parts) > 2 else ".".join(parts)

