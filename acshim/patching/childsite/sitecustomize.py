"""acshim's child-process bootstrap, found first on ``PYTHONPATH`` under ``acshim run --children``.

Python imports ``sitecustomize`` at start-up. With ``ACSHIM_PATCH_CHILDREN=1`` in the environment
this one puts a small finder on ``sys.meta_path`` that calls ``acshim.patching.install()`` the
first time the process imports one of the upstream names acshim serves (``deepspeed``,
``fairscale``, ``smdistributed``, ``torch.sagemaker``, ``modalities``, ``torchtune``, ``trl``, PyTorch's checkpoint_wrapper,
``transformers``, ``accelerate``). Processes that never import them (multiprocessing's resource
tracker, build tools) never import torch because of acshim. Any other ``sitecustomize`` on the path still runs.

This file must not import acshim at start-up: it is kept free of anything but the standard library.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

# Kept equal to acshim.patching.dialects.TRIGGER_NAMES by tests/patching/test_children.py.
TRIGGER_NAMES = (
    "deepspeed",
    "fairscale",
    "smdistributed",
    "torch.sagemaker",
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
    "modalities",
    "torchtune",
    "megatron",
    "trl",
    "torchtitan",
    "transformers",
    "accelerate",
)


def _is_trigger(fullname: str) -> bool:
    return any(fullname == name or fullname.startswith(name + ".") for name in TRIGGER_NAMES)


class _InstallOnFirstImport(importlib.abc.MetaPathFinder):
    """Installs acshim's patches just before the first upstream name is imported, then steps aside."""

    def find_spec(self, fullname, path=None, target=None):
        if not _is_trigger(fullname):
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        try:
            from acshim.patching import install
        except ImportError as error:  # this interpreter cannot see acshim (another venv, -I ...)
            sys.stderr.write(f"acshim: child process {sys.executable} cannot import acshim ({error}); "
                             "it runs without acshim's patches\n")
            return None
        install(hf=os.environ.get("ACSHIM_PATCH_HF") == "1")
        from acshim.patching.runner import report_regions_at_exit

        report_regions_at_exit(only_ranks_and_users=True)
        module = sys.modules.get(fullname)
        if module is not None:  # installing imported (and patched) it already: hand back that very module
            spec = importlib.machinery.ModuleSpec(fullname, _Existing(getattr(module, "__spec__", None)),
                                                  is_package=hasattr(module, "__path__"))
            # A module that appeared during the search is loaded again from its own ``__spec__``
            # (importlib's _find_spec): make that spec ours, which loads nothing.
            module.__spec__ = spec
            return spec
        # The import system has already passed the finders acshim just added: ask them now.
        return importlib.util.find_spec(fullname)


class _Existing(importlib.abc.Loader):
    """Loads nothing: gives back the module already in ``sys.modules`` with its original spec."""

    def __init__(self, original_spec):
        self._spec = original_spec

    def create_module(self, spec):
        return sys.modules[spec.name]

    def exec_module(self, module):
        module.__spec__ = self._spec


def _chain_next_sitecustomize() -> None:
    """Run the ``sitecustomize`` this one shadows, if there is one further down ``sys.path``."""
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None or os.path.abspath(spec.origin or "") == os.path.abspath(__file__):
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


if os.environ.get("ACSHIM_PATCH_CHILDREN") == "1":
    sys.meta_path.insert(0, _InstallOnFirstImport())
_chain_next_sitecustomize()
