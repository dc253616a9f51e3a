"""What a checkpointed region does: the engine's one options object, shared by every facade."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

DETERMINISM_CHECKS = ("default", "none")


class RegionObserver(Protocol):
    """Receives a region's lifecycle events (profiling, synchronisation, prefetch scheduling).

    Every method is optional; ``region`` is the callable being checkpointed.
    """

    def forward_start(self, region: Callable[..., Any]) -> None: ...
    def forward_end(self, region: Callable[..., Any]) -> None: ...
    def recompute_start(self, region: Callable[..., Any]) -> None: ...
    def recompute_end(self, region: Callable[..., Any]) -> None: ...
    def backward_end(self, region: Callable[..., Any]) -> None:
        """Reentrant regions only: the region's gradients are computed."""


@dataclass(frozen=True)
class RegionOptions:
    """How one region is checkpointed. Every facade's flags translate into these fields."""

    reentrant: bool = False
    """Recompute inside an ``autograd.Function`` backward (upstream "reentrant" semantics) instead
    of on first unpack of a saved tensor. Non-reentrant works with ``torch.autograd.grad``, kwargs
    and inputs that do not require grad; reentrant matches older upstream behaviour."""

    preserve_rng_state: bool = True
    """Save CPU, device and tracker RNG states in forward and restore them for the recompute, so
    dropout draws the same masks. Turning it off saves a little time and changes gradients."""

    determinism_check: str = "default"
    """Non-reentrant only: ``"default"`` compares shapes/dtypes/devices of recomputed tensors."""

    debug: bool = False
    """Non-reentrant only: record operator traces to explain a determinism mismatch."""

    early_stop: bool = True
    """Non-reentrant only: stop the recompute once every saved tensor has been rebuilt."""

    context_fn: Callable[[], tuple[AbstractContextManager[Any], AbstractContextManager[Any]]] | None = None
    """Non-reentrant only: a pair of contexts for forward and recompute, e.g. a selective-op policy
    from ``torch.utils.checkpoint.create_selective_checkpoint_contexts``."""

    saved_tensors_scope: Callable[[], AbstractContextManager[Any]] | None = None
    """A ``saved_tensors_hooks`` context entered around the region call: it sees exactly what the
    region keeps for backward (its boundary inputs) and decides where those tensors live (the
    storage tier's boundary offload)."""

    observer: RegionObserver | None = field(default=None, compare=False)
    """Lifecycle callbacks (see ``RegionObserver``)."""

    grad_error_message: str | None = None
    """Reentrant only: the RuntimeError text when ``torch.autograd.grad`` reaches the region (a
    facade sets its upstream's wording; default: torch's)."""

    dialect: str | None = field(default=None, compare=False)
    """The API that made the region (a facade sets its dialect, e.g. ``"deepspeed"``), as
    ``acshim run --report`` and the ``--budget`` plan name it; None: the engine's own API (``"acshim"``,
    see ``acshim.region_dialect``). Changes nothing in the region."""

    def __post_init__(self) -> None:
        check_options(self)

    def replace(self, **changes: Any) -> RegionOptions:
        """A copy with ``changes`` applied."""
        return replace(self, **changes)


_FLAGS = ("reentrant", "preserve_rng_state", "debug", "early_stop")
_CALLABLES = {
    "context_fn": "a function returning a (forward, recompute) pair of context managers, such as "
                  "acshim.selective.save_ops()",
    "saved_tensors_scope": "a function returning a saved_tensors_hooks context, such as "
                           "acshim.storage.boundary_offload(storage='host')",
}


def check_options(options: RegionOptions) -> None:
    """Raise ``TypeError``/``ValueError`` naming the first bad field and what it accepts, so a bad
    option fails where it is given, not at the first forward."""
    for name in _FLAGS:
        value = getattr(options, name)
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    if options.determinism_check not in DETERMINISM_CHECKS:  # torch's wording
        raise ValueError(f"determinism_check should be one of {list(DETERMINISM_CHECKS)}, "
                         f"but got {options.determinism_check}")
    for name, accepted in _CALLABLES.items():
        value = getattr(options, name)
        if value is not None and not callable(value):
            raise TypeError(f"{name} must be {accepted}, or None; got {value!r}")
    if options.reentrant and (options.context_fn is not None or options.debug):  # torch's wording
        raise ValueError("Passing context_fn or debug is only supported when use_reentrant=False. "
                         "(acshim: drop context_fn/debug or pass reentrant=False)")
    if options.grad_error_message is not None and not isinstance(options.grad_error_message, str):
        raise TypeError(f"grad_error_message must be a string or None, got {options.grad_error_message!r}")


DEFAULT_OPTIONS = RegionOptions()
