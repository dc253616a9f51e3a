"""``torch.sagemaker.distributed.checkpoint.state_dict_saver``: not provided."""

from __future__ import annotations

from ..._missing import missing_function

_INSTEAD = "use torch.distributed.checkpoint.save / async_save"
save = missing_function("torch.sagemaker.distributed.checkpoint.state_dict_saver.save", "SMP's checkpoint saver",
                        _INSTEAD)
async_save = missing_function("torch.sagemaker.distributed.checkpoint.state_dict_saver.async_save",
                              "SMP's asynchronous checkpoint saver", _INSTEAD)
maybe_finalize_async_calls = missing_function(
    "torch.sagemaker.distributed.checkpoint.state_dict_saver.maybe_finalize_async_calls",
    "SMP's asynchronous checkpoint saver", _INSTEAD)

__all__ = ["async_save", "maybe_finalize_async_calls", "save"]
