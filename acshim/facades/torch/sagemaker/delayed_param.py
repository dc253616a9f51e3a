"""``torch.sagemaker.delayed_param``: not provided (SMP's meta-device parameter initialisation)."""

from __future__ import annotations

from ._missing import missing

DelayedParamIniter = missing(
    "torch.sagemaker.delayed_param.DelayedParamIniter", "SMP's delayed (meta-device) parameter initialisation",
    "build the model on a real device, or give FSDP a param_init_fn that calls module.to_empty(...) and "
    "reset_parameters()")

__all__ = ["DelayedParamIniter"]
