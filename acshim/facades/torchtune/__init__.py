"""torchtune facade: ``torchtune.training``'s activation offloading (``OffloadActivations``,
``NoOpManager``, ``get_act_offloading_ctx_manager``, torchtune 0.6) served by ``acshim.offload``.

torchtune's own ``OffloadActivations`` needs CUDA (on CPU it raises "Torch not compiled with CUDA
enabled") and torchao; this facade runs anywhere. When torchtune is absent, ``acshim.install()`` /
``acshim run`` serve ``import torchtune.training`` from here; when it is installed, the names in
``ACSHIM_PATCHES`` are replaced in place. The tier: ``acshim.storage`` defaults, or
``ACSHIM_OFFLOAD_STORAGE=disk`` (and ``ACSHIM_OFFLOAD_DIR``) in the environment.
"""

from __future__ import annotations

__version__ = "0.6.1+acshim"
"""The torchtune API level this facade mirrors."""

_UPSTREAM = "torchtune.training._activation_offloading"
_NAMES = ("OffloadActivations", "NoOpManager", "get_act_offloading_ctx_manager")

ACSHIM_PATCHES: list[tuple[str, str, str]] = [
    (_UPSTREAM, name, f"acshim.facades.torchtune.training._activation_offloading.{name}") for name in _NAMES
]

__all__ = ["ACSHIM_PATCHES"]
