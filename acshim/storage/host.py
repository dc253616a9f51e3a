"""The host tier: bytes live in (pinned) host memory.

The backend does the copying (a CUDA side stream into regions of its pinned pool, which are the
slots); the tier only names the kind. CPU tensors never reach it: on the CPU they already are in host memory, so the session keeps
them where they are, at no cost (torch's ``save_on_cpu`` copies them, +34% held on this machine).
"""

from __future__ import annotations

import torch


class HostTier:
    """Holds host buffers handed over by a backend; nothing to allocate or free by hand."""

    kind = "host"

    def write(self, data: torch.Tensor) -> torch.Tensor:
        return data

    def read(self, slot: torch.Tensor) -> torch.Tensor:
        return slot

    def free(self, slot: torch.Tensor) -> None:
        pass
