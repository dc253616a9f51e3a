"""Opt-in patching of child processes (``acshim run --children`` or ``ACSHIM_PATCH_CHILDREN=1``).

Child Python processes (torchrun workers, ``multiprocessing`` spawn) start fresh: the patches of
the parent are not there. With the opt-in, the environment the children inherit carries
``ACSHIM_PATCH_CHILDREN=1`` and puts ``acshim/patching/childsite`` first on ``PYTHONPATH``; its
``sitecustomize`` installs the patches in each child at its first upstream import. Never on by
default: a child that should run the real upstream code must not be changed behind the user's back.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path

CHILDREN_ENV = "ACSHIM_PATCH_CHILDREN"
HF_ENV = "ACSHIM_PATCH_HF"


def childsite_dir() -> str:
    """The directory holding acshim's child ``sitecustomize``."""
    return str(Path(__file__).resolve().parent / "childsite")


def children_requested(environ: MutableMapping[str, str] | None = None) -> bool:
    """True when the environment opts in (``ACSHIM_PATCH_CHILDREN=1``)."""
    return (os.environ if environ is None else environ).get(CHILDREN_ENV) == "1"


def enable_children(*, hf: bool = False, environ: MutableMapping[str, str] | None = None) -> None:
    """Make child processes started from now on install acshim's patches (``hf``: also
    ``patch_transformers``). Edits ``environ`` (default ``os.environ``), which children inherit."""
    environ = os.environ if environ is None else environ
    environ[CHILDREN_ENV] = "1"
    if hf:
        environ[HF_ENV] = "1"
    site = childsite_dir()
    entries = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != site]
    environ["PYTHONPATH"] = os.pathsep.join([site, *entries])
