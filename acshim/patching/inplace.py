"""Replace an installed upstream package's checkpointing entry points in place.

A facade's root module lists them in ``ACSHIM_PATCHES`` as ``(upstream_module, attribute,
facade_object_path)``. Functions are wrapped with ``wrapt.FunctionWrapper`` (the upstream name,
signature and ``__wrapped__`` stay; calls go to the facade). Classes, descriptors and other
non-functions cannot be forwarded by a wrapper (``isinstance`` and subclassing need the real
class), so they are replaced by the facade object itself. Copies other modules of the same
upstream package took with ``from x import name`` are replaced too. Modules not imported yet are
patched when first imported (``wrapt.register_post_import_hook``).
"""

from __future__ import annotations

import inspect
import pkgutil
import sys
import types
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import wrapt

from .journal import Journal, PatchWarning

# wrapt >= 2.4 raises PathResolutionError for a missing attribute; older ones let AttributeError out.
_MISSING_ATTRIBUTE: tuple[type[BaseException], ...] = (AttributeError, *(
    (wrapt.PathResolutionError,) if hasattr(wrapt, "PathResolutionError") else ()))

# Entry points the engine itself calls: forwarding them to a facade would recurse into it.
_ENGINE_OWNED = ("torch.utils.checkpoint",)


class PatchError(RuntimeError):
    """An ``ACSHIM_PATCHES`` entry is malformed or cannot be applied."""


@dataclass(frozen=True)
class PatchEntry:
    """One ``ACSHIM_PATCHES`` row: replace ``upstream_module.attribute`` by ``facade_path``."""

    upstream_module: str
    attribute: str
    facade_path: str
    source: str = ""  # the facade module that listed it, for error messages

    @classmethod
    def parse(cls, raw: object, source: str) -> PatchEntry:
        if not (isinstance(raw, tuple | list) and len(raw) == 3 and all(isinstance(x, str) and x for x in raw)):
            raise PatchError(
                f"{source}.ACSHIM_PATCHES: each entry must be a tuple (upstream_module, attribute, "
                f"facade_object_dotted_path) of non-empty strings, got {raw!r}")
        upstream_module, attribute, facade_path = raw
        if upstream_module in _ENGINE_OWNED or upstream_module.startswith(tuple(m + "." for m in _ENGINE_OWNED)):
            raise PatchError(
                f"{source}.ACSHIM_PATCHES: {upstream_module}.{attribute} is called by acshim's engine itself; "
                "patching it would make the engine call back into the facade. Patch the upstream "
                "module that calls it instead.")
        return cls(upstream_module, attribute, facade_path, source)

    @property
    def target(self) -> str:
        return f"{self.upstream_module}.{self.attribute}"

    @property
    def package(self) -> str:
        return self.upstream_module.split(".")[0]


def entries_of(facade_root: types.ModuleType) -> list[PatchEntry]:
    """The validated ``ACSHIM_PATCHES`` of a facade root module (empty when it lists none)."""
    raw = getattr(facade_root, "ACSHIM_PATCHES", [])
    if not isinstance(raw, list | tuple):
        raise PatchError(f"{facade_root.__name__}.ACSHIM_PATCHES must be a list of tuples, got {type(raw).__name__}")
    return [PatchEntry.parse(item, facade_root.__name__) for item in raw]


def resolve_facade_object(entry: PatchEntry) -> Any:
    try:
        return pkgutil.resolve_name(entry.facade_path)
    except (ImportError, AttributeError, ValueError) as error:
        raise PatchError(
            f"{entry.source}.ACSHIM_PATCHES names {entry.facade_path!r} for {entry.target}, which does not "
            f"resolve: {error}") from error


def make_replacement(original: Any, facade_object: Any) -> Any:
    """What goes in place of ``original``: a wrapt wrapper forwarding to the facade for plain
    functions, the facade object itself for classes, descriptors and values."""
    if _is_plain_function(original):
        return wrapt.FunctionWrapper(original, _forward_to(facade_object))
    return facade_object


def _is_plain_function(obj: Any) -> bool:
    if inspect.isclass(obj) or isinstance(obj, staticmethod | classmethod | property):
        return False
    return callable(obj) and (inspect.isroutine(obj) or isinstance(obj, wrapt.FunctionWrapper))


def _forward_to(facade_object: Any) -> Callable[..., Any]:
    def forward(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        # wrapt hands a method's ``self`` separately; the facade function takes it positionally.
        if instance is not None and not inspect.ismodule(instance):
            return facade_object(instance, *args, **kwargs)
        return facade_object(*args, **kwargs)

    forward.acshim_facade_object = facade_object  # type: ignore[attr-defined]
    return forward


def is_acshim_wrapper(obj: Any) -> bool:
    """True when ``obj`` is a wrapper acshim installed in place of an upstream function."""
    return isinstance(obj, wrapt.FunctionWrapper) and hasattr(obj._self_wrapper, "acshim_facade_object")


def apply_entries(module: types.ModuleType, entries: Iterable[tuple[PatchEntry, Any]], journal: Journal,
                  missing: Callable[[PatchEntry, str], None]) -> None:
    """Patch ``module`` with each ``(entry, facade_object)``; record every change in ``journal``.

    An attribute absent from this upstream version is reported to ``missing`` and skipped.
    """
    for entry, facade_object in entries:
        try:
            owner, attribute, original = wrapt.resolve_path(module, entry.attribute)
        except _MISSING_ATTRIBUTE as error:
            missing(entry, f"{entry.target} does not exist in the installed version ({error})")
            continue
        if original is facade_object or is_acshim_wrapper(original):
            continue
        replacement = make_replacement(original, facade_object)
        if owner is module:
            # Modules imported after this patch copy the replacement with ``from x import name``;
            # uninstall sweeps those bindings back to the original (runs after the undos below).
            journal.record(f"copies of {entry.target}",
                           lambda r=replacement, o=original, p=entry.package: _sweep(p, r, o))
        journal.set_attribute(owner, attribute, replacement)
        if owner is module:
            replace_copies(entry.package, module, original, replacement, journal)


def _package_modules(package: str) -> Iterable[types.ModuleType]:
    prefix = package + "."
    for name, module in list(sys.modules.items()):
        if isinstance(module, types.ModuleType) and (name == package or name.startswith(prefix)):
            yield module


def _sweep(package: str, replacement: Any, original: Any) -> None:
    for module in _package_modules(package):
        for attribute, value in list(vars(module).items()):
            if value is replacement:
                setattr(module, attribute, original)


def replace_copies(package: str, defining: types.ModuleType, original: Any, replacement: Any, journal: Journal) -> None:
    """Replace ``original`` by ``replacement`` wherever another module of ``package`` bound it by
    name (``from .checkpoint_activations import checkpoint_wrapper`` in ``fairscale.nn``).

    A placeholder value (``None``, a number, a string: Megatron's ``get_cpu_offload_context = None``
    without Transformer Engine) has no copies: other attributes equal to it are unrelated."""
    if original is None or isinstance(original, bool | int | float | str):
        return
    for module in _package_modules(package):
        if module is defining:
            continue
        for attribute, value in list(vars(module).items()):
            if value is original:
                journal.set_attribute(module, attribute, replacement)


class DeferredPatches:
    """Patches for upstream modules not imported yet, applied by a post-import hook.

    A failure inside the hook must not break the user's import: that module's patches are rolled
    back, a ``PatchWarning`` says why, and the upstream code runs unpatched.
    """

    def __init__(self, module_name: str, entries: list[tuple[PatchEntry, Any]], journal: Journal,
                 missing: Callable[[PatchEntry, str], None]) -> None:
        self.module_name = module_name
        self.entries = entries
        self.journal = journal
        self.missing = missing
        self.active = True
        self.applied = False

    def register(self) -> None:
        wrapt.register_post_import_hook(self, self.module_name)

    def __call__(self, module: types.ModuleType) -> None:
        if not self.active or self.applied:
            return
        changes = Journal()
        try:
            apply_entries(module, self.entries, changes, self.missing)
        except Exception as error:
            changes.rollback()
            warnings.warn(f"acshim: could not patch {self.module_name} at import ({error}); it runs unpatched",
                          PatchWarning, stacklevel=2)
            return
        self.journal.extend(changes)
        self.applied = True

    def unregister(self) -> None:
        """Deactivate, and drop the hook from wrapt's registry if the module was never imported."""
        self.active = False
        unregister_post_import_hook(self, self.module_name)


def unregister_post_import_hook(hook: Callable[[types.ModuleType], Any], module_name: str) -> None:
    """Remove ``hook`` from wrapt's registry of post-import hooks for ``module_name``.

    wrapt has no public call for this; its registry is a dict of lists
    (``wrapt.importer._post_import_hooks``). Callers also make their hooks inert with a flag,
    so a leftover hook does nothing should that private layout change.
    """
    importer = getattr(wrapt, "importer", None)
    registry = getattr(importer, "_post_import_hooks", None)
    lock = getattr(importer, "_post_import_hooks_lock", None)
    if not isinstance(registry, dict) or lock is None:
        return
    with lock:
        hooks = registry.get(module_name)
        if hooks and hook in hooks:
            hooks.remove(hook)
            if not hooks:
                del registry[module_name]
