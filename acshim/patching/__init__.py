"""Patching layer: run scripts written for DeepSpeed, FairScale, SageMaker, PyTorch's
checkpoint_wrapper, Modalities and Hugging Face on acshim without editing them.

``install()`` serves absent upstream packages from their facades under the upstream import names
and replaces the checkpointing entry points of installed ones in place; ``uninstall()`` undoes it
exactly. ``acshim run script.py`` (see ``acshim.patching.runner``) runs a script with both.
"""

from __future__ import annotations

from .dialects import DIALECTS, Dialect, decide, dialect_named
from .inplace import PatchEntry, PatchError
from .installation import DialectReport, Installation, current, install, is_installed, uninstall
from .journal import PatchWarning

__all__ = [
    "DIALECTS", "Dialect", "DialectReport", "Installation", "PatchEntry", "PatchError", "PatchWarning",
    "current", "decide", "dialect_named", "install", "is_installed", "uninstall",
]
