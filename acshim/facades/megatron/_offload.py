"""``TransformerConfig(cpu_offloading=True, cpu_offloading_num_layers=n)`` on acshim's storage tier.

``TransformerBlock`` enters ``self.offload_context`` around every layer; upstream builds it with
Transformer Engine's ``get_cpu_offload_context(enabled, num_layers, model_layers,
offload_activations, offload_weights, double_buffering)`` (without TE it refuses ``cpu_offloading``
with an AssertionError). This replacement offloads the activations saved inside the first
``num_layers`` layers of each forward to the storage tier (``acshim.storage.OffloadActivations``),
chosen as for torchtune: the engine default (host) or ``ACSHIM_OFFLOAD_STORAGE`` /
``ACSHIM_OFFLOAD_DIR``. Gradients are bitwise unchanged. ``offload_weights=True`` raises
(weight offload is not served); ``double_buffering`` is what the tier's prefetch already does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from acshim.storage.scopes import OffloadActivations

from .._env import offload_storage


class LayerOffload:
    """The context a ``TransformerBlock`` enters around each layer: layers ``0 .. num_layers - 1`` of
    every forward (counted modulo ``model_layers``) save to the storage tier, later ones stay put."""

    def __init__(self, num_layers: int, model_layers: int) -> None:
        self.num_layers = num_layers
        self.model_layers = model_layers
        self.entered = 0
        self.scopes: list[OffloadActivations] = []  # this forward's, kept until the next forward
        self._active: list[Any] = []
        # Megatron's linear layers tag their input for TE's offloader while ``inside_context`` is
        # True (and assert TE is present); every tensor saved inside this scope goes to the tier
        # anyway, so no tagging is needed and it stays False.
        self.inside_context = False

    def __enter__(self) -> LayerOffload:
        layer = self.entered % self.model_layers
        self.entered += 1
        if layer == 0:
            self.scopes = []
        if layer < self.num_layers:
            storage, directory = offload_storage()
            scope = OffloadActivations(storage=storage, directory=directory)
            self.scopes.append(scope)
            scope.__enter__()
            self._active.append(scope)
        else:
            self._active.append(contextlib.nullcontext())
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._active.pop().__exit__(*exc_info)

    def moved_bytes(self) -> int:
        """Bytes this forward's layers sent to the tier."""
        return sum(scope.stats.moved_bytes for scope in self.scopes if scope.stats is not None)


def get_cpu_offload_context(enabled: bool = False, num_layers: int = 1, model_layers: int = 1,
                            offload_activations: bool = True, offload_weights: bool = False,
                            double_buffering: bool = False) -> tuple[Any, Callable[[Any], Any] | None]:
    """``(context, commit)`` as Megatron's ``TransformerBlock`` expects them."""
    if not enabled:
        return contextlib.nullcontext(), None
    if offload_weights:
        raise ValueError("TransformerConfig(cpu_offloading_weights=True): weight offload is not served by acshim; "
                         "set cpu_offloading_weights=False (activations are offloaded to acshim's storage tier)")
    if not offload_activations:
        return contextlib.nullcontext(), None
    return LayerOffload(num_layers, model_layers), (lambda hidden_states: hidden_states)
