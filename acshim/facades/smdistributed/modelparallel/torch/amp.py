"""``smp.amp``: ``GradScaler`` is torch's (upstream subclasses ``torch.cuda.amp.GradScaler`` to reduce
the inf check across ranks; one process has nothing to reduce)."""

from __future__ import annotations

from typing import Any

import torch


class GradScaler(torch.amp.GradScaler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("device", "cuda" if torch.cuda.is_available() else "cpu")
        super().__init__(*args, **kwargs)


__all__ = ["GradScaler"]
