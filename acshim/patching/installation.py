"""``install()`` / ``uninstall()``: make upstream checkpointing APIs run on acshim, process-wide.

Per dialect (see ``dialects.DIALECTS``): an absent upstream package is served by its facade under
the upstream import name (``FacadeFinder``); an installed one keeps working, with only the entry
points in its facade's ``ACSHIM_PATCHES`` replaced in place. Hugging Face entry points are handed
to ``acshim.hf`` when that package provides ``install``/``uninstall``.

Every change goes into one ``Journal``: ``uninstall()`` reverts it exactly, and an install that
fails midway reverts what it did before re-raising, so nothing is ever left half-patched.
"""

from __future__ import annotations

import importlib
import sys
import threading
import types
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import wrapt

from .aliasing import FacadeFinder
from .dialects import DIALECTS, Dialect, Mode, decide, dialect_named, module_exists
from .inplace import (
    DeferredPatches,
    PatchEntry,
    apply_entries,
    entries_of,
    resolve_facade_object,
    unregister_post_import_hook,
)
from .journal import Journal, PatchWarning


@dataclass
class DialectReport:
    """What ``install()`` did for one dialect."""

    dialect: Dialect
    mode: Mode
    patched_now: list[str] = field(default_factory=list)      # upstream targets replaced at install
    deferred: list[str] = field(default_factory=list)         # modules patched when first imported
    missing: list[str] = field(default_factory=list)          # entries absent from this upstream version


@dataclass
class Installation:
    """The live state of one ``install()``: undo journal, finder, hooks and reports."""

    journal: Journal = field(default_factory=Journal)
    finder: FacadeFinder | None = None
    deferred: list[DeferredPatches] = field(default_factory=list)
    reports: dict[str, DialectReport] = field(default_factory=dict)
    transformers: bool = False   # acshim.hf.install() was (or will be, at import) called
    hf_models: bool = False      # acshim.patch_transformers() was (or will be) called

    def undo(self) -> list[str]:
        for hook in self.deferred:
            hook.unregister()
        self.deferred.clear()
        failures = self.journal.rollback()
        if self.finder is not None:
            self.finder.remove_served_modules()
            self.finder = None
        return failures


_lock = threading.RLock()
_current: Installation | None = None


def install(*, dialects: Iterable[str | Dialect] | str | None = None, hf: bool = False,
            transformers: bool = True) -> Installation:
    """Make upstream checkpointing APIs run on acshim in this process. Idempotent.

    ``dialects`` limits the dialects served (a name or a list of names from
    ``acshim.patching.DIALECTS``; default all). ``transformers`` hands HF's checkpointing entry
    points to ``acshim.hf`` (when it provides ``install``; it does not import transformers);
    ``hf=True`` also calls ``acshim.patch_transformers()`` so every HF model is checkpointed
    automatically, at ``import transformers`` if that has not happened yet.

    Raises ``PatchError`` (or the import error of a broken facade) after undoing everything it
    had changed. Calling it again while installed returns the current installation unchanged;
    call ``uninstall()`` first to change options.
    """
    global _current
    chosen = _chosen_dialects(dialects)
    for name, value in (("hf", hf), ("transformers", transformers)):
        if not isinstance(value, bool):
            raise TypeError(f"install: {name} must be True or False, got {value!r}")
    with _lock:
        if _current is not None:
            return _current
        installation = Installation()
        try:
            _install_dialects(installation, chosen)
            if transformers or hf:
                _install_transformers(installation, transformers=transformers, hf=hf)
        except BaseException:
            installation.undo()
            raise
        _current = installation
        return installation


def _chosen_dialects(dialects: Iterable[str | Dialect] | str | Dialect | None) -> list[Dialect]:
    """The dialects ``install(dialects=...)`` names: None is all; a bare name or ``Dialect`` is one."""
    if dialects is None:
        return list(DIALECTS)
    if isinstance(dialects, (str, Dialect)):
        dialects = [dialects]
    try:
        items = list(dialects)
    except TypeError:
        raise TypeError(f"install: dialects must be a dialect name or a list of them (e.g. ['deepspeed', 'torch']), "
                        f"got {dialects!r}") from None
    chosen = []
    for item in items:
        if isinstance(item, Dialect):
            chosen.append(item)
        elif isinstance(item, str):
            chosen.append(dialect_named(item))
        else:
            raise TypeError(f"install: dialects must hold dialect names (strings), got {item!r}")
    return chosen


def uninstall() -> None:
    """Undo everything ``install()`` did: original objects back (the same objects), finder and
    hooks removed, upstream names served by facades dropped from ``sys.modules``. Idempotent."""
    global _current
    with _lock:
        installation, _current = _current, None
        if installation is not None:
            failures = installation.undo()
            if failures:
                warnings.warn("acshim: uninstall left changes it could not undo: " + "; ".join(failures),
                              PatchWarning, stacklevel=2)
    from ..head import remove_all  # chunked heads a plan put on models (and TRL's chunk size)
    from ..storage import unwind  # the storage tier's wrapper of torch's backward entry, if it put one

    unwind.restore()
    remove_all()
    _reset_observers()


def _reset_observers() -> None:
    """The process-wide observers go with the patches: the offload sessions' observers (the report's,
    ``recording()``'s) and the facades' diagnostics watchers, their patches undone (DeepSpeed's
    ``initialize`` back). The report's recorder is region state, like the counts ``acshim run``
    prints at exit: ``acshim.report.stop()`` drops it, ``start()`` hooks it up again."""
    from ..diagnostics import DIAGNOSTICS
    from ..storage.observers import SESSION_OBSERVERS

    SESSION_OBSERVERS.clear()
    DIAGNOSTICS.reset()


def is_installed() -> bool:
    """True between ``install()`` and ``uninstall()``."""
    return _current is not None


def current() -> Installation | None:
    """The live installation, or None."""
    return _current


# --------------------------------------------------------------------------------------------------


def _install_dialects(installation: Installation, dialects: list[Dialect]) -> None:
    shimmed = []
    for dialect in dialects:
        mode = decide(dialect)
        report = installation.reports[dialect.name] = DialectReport(dialect, mode)
        if mode == "shim":
            shimmed.append(dialect)
        elif mode == "patch":
            _patch_in_place(installation, dialect, report)
    if any(dialect.name == "torch" for dialect in dialects):
        # torch's own offload policies (MUST_CPU_OFFLOAD / PREFER_CPU_OFFLOAD) offload in eager mode
        from .torch_route import route_offload_policies, unroute_offload_policies

        if route_offload_policies():
            installation.journal.record("torch.utils.checkpoint for offload policies", unroute_offload_policies)
    if shimmed:
        finder = FacadeFinder(shimmed)
        sys.meta_path.insert(0, finder)
        installation.finder = finder
        installation.journal.record("FacadeFinder on sys.meta_path", lambda: _remove_finder(finder))


def _remove_finder(finder: FacadeFinder) -> None:
    if finder in sys.meta_path:
        sys.meta_path.remove(finder)


def _patch_in_place(installation: Installation, dialect: Dialect, report: DialectReport) -> None:
    facade_root = importlib.import_module(dialect.facade)
    by_module: dict[str, list[tuple[PatchEntry, Any]]] = {}
    for entry in entries_of(facade_root):
        by_module.setdefault(entry.upstream_module, []).append((entry, resolve_facade_object(entry)))

    def missing(entry: PatchEntry, why: str) -> None:
        # Facades list names across upstream versions; one this version lacks is reported by
        # ``acshim doctor``, not warned about on every run.
        report.missing.append(why)

    for module_name, entries in by_module.items():
        module = sys.modules.get(module_name)
        if module is not None:
            apply_entries(module, entries, installation.journal, missing)
            report.patched_now.extend(entry.target for entry, _ in entries)
        elif module_exists(module_name):
            hook = DeferredPatches(module_name, entries, installation.journal, missing)
            installation.deferred.append(hook)
            hook.register()
            report.deferred.append(module_name)
        else:
            for entry, _ in entries:
                missing(entry, f"module {module_name} does not exist in the installed {dialect.upstream}")


# --------------------------------------------------------------------------------------------------
# Hugging Face: acshim.hf owns the patches; this only calls it, at transformers' import if need be.


def _hf_function(name: str) -> Callable[[], Any] | None:
    if not module_exists("acshim.hf"):
        return None
    function = getattr(importlib.import_module("acshim.hf"), name, None)
    return function if callable(function) else None


def _install_transformers(installation: Installation, *, transformers: bool, hf: bool) -> None:
    if transformers and (module_exists("transformers") or module_exists("accelerate")):
        hf_install, hf_uninstall = _hf_function("install"), _hf_function("uninstall")
        if hf_install is not None and hf_uninstall is not None:
            hf_install()  # registers its own import hooks; does not import transformers
            installation.journal.record("acshim.hf.install", hf_uninstall)
            installation.transformers = True
        if module_exists("transformers"):
            # transformers models that call torch's checkpoint themselves (not through
            # _gradient_checkpointing_func) run on the engine too
            from .torch_route import TRANSFORMERS_CALLERS, route_torch_checkpoint, unroute_torch_checkpoint

            if route_torch_checkpoint(TRANSFORMERS_CALLERS):
                installation.journal.record("torch.utils.checkpoint for transformers' callers",
                                            lambda: unroute_torch_checkpoint(TRANSFORMERS_CALLERS))
    if hf:
        _auto_checkpoint_transformers(installation)


def _auto_checkpoint_transformers(installation: Installation) -> None:
    """``acshim.patch_transformers()``, once transformers is imported (it imports transformers,
    which a script that never uses it should not pay for)."""
    if not module_exists("transformers"):
        raise ImportError("acshim: --hf needs transformers, which is not installed: pip install 'acshim[hf]'")
    patch, unpatch = _hf_function("patch_transformers"), _hf_function("unpatch_transformers")
    if patch is None or unpatch is None:
        raise ImportError("acshim: --hf needs acshim.hf.patch_transformers, which this acshim lacks")
    state = {"done": False, "active": True}

    def run(module: types.ModuleType | None = None) -> None:
        if state["done"] or not state["active"]:
            return
        state["done"] = True
        try:
            patch()
        except Exception as error:
            if module is None:  # at install(): fail it (the caller rolls back everything)
                raise
            warnings.warn(f"acshim: could not auto-checkpoint transformers models ({error})", PatchWarning,
                          stacklevel=2)
            return
        installation.journal.record("acshim.patch_transformers", unpatch)

    def deactivate() -> None:
        state["active"] = False
        unregister_post_import_hook(run, "transformers")

    installation.hf_models = True
    installation.journal.record("transformers import hook", deactivate)
    if "transformers" in sys.modules:
        run()
    else:
        wrapt.register_post_import_hook(run, "transformers")
