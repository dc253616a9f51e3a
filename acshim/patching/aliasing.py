"""Serve a facade under its upstream import name when the upstream package is absent.

``FacadeFinder`` sits first on ``sys.meta_path``: ``import deepspeed.runtime.x`` finds the module
``acshim.facades.deepspeed.runtime.x`` and registers that same module object in ``sys.modules``
under the upstream name. Nothing is copied, so state set through either name is shared.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import types
from collections.abc import Iterable

from .dialects import Dialect


class FacadeFinder(importlib.abc.MetaPathFinder):
    """Meta-path finder mapping upstream module names to facade modules.

    Only names with a facade module behind them are claimed; any other name falls through to the
    normal finders (so ``import deepspeed.not_in_facade`` fails as it would without acshim).
    """

    acshim_alias_finder = True  # lets acshim's own lookups see past this finder

    def __init__(self, dialects: Iterable[Dialect]) -> None:
        self.dialects = tuple(dialects)
        self.served: dict[str, types.ModuleType] = {}  # upstream name -> facade module, as imported
        self._lock = threading.Lock()

    def facade_name_for(self, fullname: str) -> str | None:
        for dialect in self.dialects:
            facade_name = dialect.facade_name_for(fullname)
            if facade_name is not None:
                return facade_name
        return None

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        facade_name = self.facade_name_for(fullname)
        if facade_name is None:
            return None
        try:
            facade_spec = importlib.util.find_spec(facade_name)
        except ModuleNotFoundError as error:
            # The facade lacks this module (or a parent of it): not ours to serve. Any other missing
            # module is a real error inside the facade and must surface as such.
            if error.name is not None and (facade_name + ".").startswith(error.name + "."):
                return None
            raise
        if facade_spec is None:
            return None
        return importlib.machinery.ModuleSpec(
            fullname, _AliasLoader(self, facade_name), is_package=facade_spec.submodule_search_locations is not None)

    def record(self, fullname: str, module: types.ModuleType) -> None:
        with self._lock:
            self.served[fullname] = module

    def remove_served_modules(self) -> None:
        """Take every upstream name this finder served out of ``sys.modules`` and off its parent."""
        with self._lock:
            served, self.served = self.served, {}
        for fullname, module in sorted(served.items(), key=lambda item: -item[0].count(".")):
            if sys.modules.get(fullname) is module:
                del sys.modules[fullname]
            parent_name, _, child = fullname.rpartition(".")
            parent = sys.modules.get(parent_name)
            # The import system set ``parent.child = module``; undo it on real parents (``torch``
            # for ``torch.sagemaker``). A facade parent already had that attribute of its own.
            if parent is not None and parent_name not in served and getattr(parent, "__name__", None) == parent_name:
                if vars(parent).get(child) is module:
                    delattr(parent, child)


class _AliasLoader(importlib.abc.Loader):
    """Loads an upstream name by importing the facade module and handing back that same object."""

    def __init__(self, finder: FacadeFinder, facade_name: str) -> None:
        self.finder = finder
        self.facade_name = facade_name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = importlib.import_module(self.facade_name)
        # The import system overwrites ``__spec__`` of whatever create_module returns; keep the
        # facade's own so the facade module still describes itself (reload, pickling, inspect).
        self._facade_spec = module.__spec__
        self._upstream_name = spec.name
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__spec__ = self._facade_spec
        self.finder.record(self._upstream_name, module)

