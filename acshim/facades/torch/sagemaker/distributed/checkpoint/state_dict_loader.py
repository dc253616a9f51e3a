"""``torch.sagemaker.distributed.checkpoint.state_dict_loader``: not provided."""

from __future__ import annotations

from ..._missing import missing_function

load = missing_function("torch.sagemaker.distributed.checkpoint.state_dict_loader.load", "SMP's checkpoint loader",
                        "use torch.distributed.checkpoint.load")

__all__ = ["load"]
