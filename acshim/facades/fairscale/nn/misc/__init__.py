"""``fairscale.nn.misc``: the deprecated import path of ``checkpoint_wrapper`` (upstream keeps it
for old scripts; the real home is ``fairscale.nn.checkpoint``)."""

from __future__ import annotations

from ..checkpoint import checkpoint_wrapper

__all__ = ["checkpoint_wrapper"]
