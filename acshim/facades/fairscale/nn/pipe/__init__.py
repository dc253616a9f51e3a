"""``fairscale.nn.pipe``: only its own ``is_checkpointing`` / ``is_recomputing``.

Upstream's Pipe keeps these flags separate from ``fairscale.nn.checkpoint``'s: a module asking
``fairscale.nn.pipe.is_recomputing()`` learns about Pipe's micro-batch recompute only. Pipe itself is
not provided, so the flags stay False unless a caller sets them with the context managers in
``fairscale.nn.pipe.checkpoint``.
"""

from __future__ import annotations

from .checkpoint import is_checkpointing, is_recomputing


def __getattr__(name: str) -> object:
    if name in {"Pipe", "AsyncPipe", "PipeRPCWrapper", "LazyModule"}:
        raise AttributeError(
            f"fairscale.nn.pipe.{name} is not provided by acshim's FairScale facade, which covers activation "
            "checkpointing only; install fairscale to use pipeline parallelism")
    raise AttributeError(f"module 'fairscale.nn.pipe' has no attribute {name!r}")


__all__ = ["is_checkpointing", "is_recomputing"]
