"""Run from a source checkout as from an installed wheel.

setup.py installs the repository-root folders ``backends/`` and ``csrc/`` as ``acshim.backends`` and
``acshim._csrc``. In a source checkout (``python -m pytest`` or a script run from the repository
root) those folders are not inside ``acshim/``; this maps them the same way so both layouts import
identically. The mapping runs when this module is imported, which ``acshim/__init__.py`` does before
any module that imports ``acshim.backends``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SUBPACKAGES = (("acshim.backends", "backends"), ("acshim._csrc", "csrc"))


def map_source_tree_subpackages() -> None:
    """Register ``backends/`` and ``csrc/`` as subpackages when running from a source checkout."""
    root = Path(__file__).resolve().parent.parent
    if not (root / "setup.py").is_file():
        return  # an installed package: setup.py already put them in place
    package = sys.modules[__package__]
    for name, folder in SUBPACKAGES:
        init = root / folder / "__init__.py"
        if name in sys.modules or not init.is_file():
            continue
        spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(init.parent)])
        if spec is None or spec.loader is None:
            continue
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        setattr(package, name.rpartition(".")[2], module)


map_source_tree_subpackages()
