"""Facade of ``smdistributed`` (SageMaker model parallelism v1): ``smdistributed.modelparallel.torch``.

The real package is closed source and never installed here, so nothing is patched in place: the
import hook serves this whole facade under the name ``smdistributed``.
"""

from __future__ import annotations

ACSHIM_PATCHES: list[tuple[str, str, str]] = []
