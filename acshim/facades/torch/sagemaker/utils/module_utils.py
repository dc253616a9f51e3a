"""``torch.sagemaker.utils.module_utils``: not provided (helpers of SMP's delayed parameter initialisation)."""

from __future__ import annotations

from .._missing import missing_function

_INSTEAD = "use module.to_empty(device=...) and module.to(device) from PyTorch"
empty_module_params = missing_function("torch.sagemaker.utils.module_utils.empty_module_params",
                                       "SMP's meta-device parameter helper", _INSTEAD)
move_buffers_to_device = missing_function("torch.sagemaker.utils.module_utils.move_buffers_to_device",
                                          "SMP's buffer placement helper", _INSTEAD)

__all__ = ["empty_module_params", "move_buffers_to_device"]
