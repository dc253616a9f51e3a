"""The dialects acshim can stand in for: each upstream import name and the facade package behind it.

Also decides, per dialect, how ``install()`` serves it: when the upstream package is absent its
import names resolve to the facade (``"shim"``); when it is installed, only the entry points the
facade lists in ``ACSHIM_PATCHES`` are replaced in place (``"patch"``).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from dataclasses import dataclass
from typing import Literal

Mode = Literal["shim", "patch", "no facade"]


@dataclass(frozen=True)
class Dialect:
    """One upstream API.

    ``upstream`` is the import name users write (``"deepspeed"``, ``"torch.sagemaker"``); every
    module below it maps to the same path below ``facade``. ``distribution`` is the name pip knows
    the upstream package by (for version reports).
    """

    name: str
    upstream: str
    facade: str
    distribution: str | None = None
    patch_only: bool = False
    """The facade only patches the installed package (it cannot stand in for the whole of it)."""
    diagnostics: str | None = None
    """The facade module that tells ``acshim.diagnostics`` which of its settings do nothing here
    (imported when ``acshim run --report`` starts)."""

    def facade_name_for(self, upstream_name: str) -> str | None:
        """``deepspeed.runtime.x`` -> ``acshim.facades.deepspeed.runtime.x``; None when outside."""
        if upstream_name == self.upstream:
            return self.facade
        if upstream_name.startswith(self.upstream + "."):
            return self.facade + upstream_name[len(self.upstream):]
        return None


DIALECTS: tuple[Dialect, ...] = (
    Dialect("deepspeed", "deepspeed", "acshim.facades.deepspeed", "deepspeed",
            diagnostics="acshim.facades.deepspeed.runtime.activation_checkpointing._report_checks"),
    Dialect("fairscale", "fairscale", "acshim.facades.fairscale", "fairscale"),
    Dialect("smdistributed", "smdistributed", "acshim.facades.smdistributed", "smdistributed-modelparallel"),
    Dialect("torch.sagemaker", "torch.sagemaker", "acshim.facades.torch.sagemaker", "torch-sagemaker"),
    Dialect(
        "torch",
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
        "acshim.facades.torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
        "torch",
    ),
    Dialect("modalities", "modalities", "acshim.facades.modalities", "modalities"),
    Dialect("torchtune", "torchtune", "acshim.facades.torchtune", "torchtune"),
    Dialect("megatron", "megatron", "acshim.facades.megatron", "megatron-core"),
    Dialect("trl", "trl", "acshim.facades.trl", "trl"),
    Dialect("torchtitan", "torchtitan", "acshim.facades.torchtitan", "torchtitan", patch_only=True),
)

# Import names whose first import makes a child process install the patches (see childsite/).
TRIGGER_NAMES: tuple[str, ...] = tuple(d.upstream for d in DIALECTS) + ("transformers", "accelerate")


def dialect_named(name: str) -> Dialect:
    """The dialect called ``name`` (``"deepspeed"``, ``"torch"``...); ValueError lists the valid names."""
    for dialect in DIALECTS:
        if dialect.name == name:
            return dialect
    raise ValueError(f"unknown dialect {name!r}; choose from {', '.join(d.name for d in DIALECTS)}")


def module_exists(name: str) -> bool:
    """True when ``import name`` would find a real module, without importing ``name`` itself.

    The top-level package is looked up through every finder except acshim's own alias finder
    (editable installs use their own finders); lower levels are searched in the parent's
    ``__path__`` so that no upstream package code runs just to answer the question. Modules
    already imported count only if they are not acshim aliases.
    """
    parts = name.split(".")
    spec = None
    for depth in range(len(parts)):
        prefix = ".".join(parts[: depth + 1])
        if prefix in sys.modules:
            module = sys.modules[prefix]
            if module is None or getattr(module, "__name__", None) != prefix:
                return False  # blocked, or an acshim alias of a facade module
            spec = module.__spec__
        elif depth == 0:
            spec = _find_top_level(prefix)
        elif spec is None or spec.submodule_search_locations is None:
            return False
        else:
            spec = importlib.machinery.PathFinder.find_spec(prefix, list(spec.submodule_search_locations))
        if spec is None and prefix not in sys.modules:
            return False
    return True


def _find_top_level(name: str) -> importlib.machinery.ModuleSpec | None:
    for finder in list(sys.meta_path):
        if getattr(finder, "acshim_alias_finder", False):
            continue
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        try:
            spec = find_spec(name, None)
        except ImportError:  # a finder that blocks the name (as tests and sandboxes do)
            return None
        if spec is not None:
            return spec
    return None


def facade_exists(dialect: Dialect) -> bool:
    """True when the facade package of ``dialect`` is present in this acshim."""
    return module_exists(dialect.facade)


def decide(dialect: Dialect) -> Mode:
    """How ``install()`` would serve ``dialect`` in this environment (no import side effects)."""
    if not facade_exists(dialect):
        return "no facade"
    if module_exists(dialect.upstream):
        return "patch"
    return "no facade" if dialect.patch_only else "shim"
