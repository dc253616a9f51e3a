"""TRL facade: ``trl.models``' activation offloading (``OffloadActivations``, ``NoOpManager``,
``get_act_offloading_ctx_manager``, TRL 1.16; what ``SFTConfig(activation_offloading=True)`` and the
DPO, KTO and reward trainers call) served by ``acshim.offload``.

TRL's ``OffloadActivations`` is torchtune's design ported; on CPU it fails at construction
(``torch.accelerator.current_accelerator()`` is None). When TRL is installed, ``acshim.install()`` /
``acshim run`` replace the names in ``ACSHIM_PATCHES`` in place (and the trainers' copies); without
TRL, ``import trl.models`` is served from here. The tier is chosen as for torchtune: ``acshim.storage``
defaults, or ``ACSHIM_OFFLOAD_STORAGE=disk`` (and ``ACSHIM_OFFLOAD_DIR``) in the environment.
"""

from __future__ import annotations

__version__ = "1.16.0+acshim"
"""The TRL API level this facade mirrors."""

_UPSTREAM = "trl.models.activation_offloading"
_NAMES = ("OffloadActivations", "NoOpManager", "get_act_offloading_ctx_manager")

ACSHIM_PATCHES: list[tuple[str, str, str]] = [
    (_UPSTREAM, name, f"acshim.facades.trl.models.activation_offloading.{name}") for name in _NAMES
]

__all__ = ["ACSHIM_PATCHES"]
