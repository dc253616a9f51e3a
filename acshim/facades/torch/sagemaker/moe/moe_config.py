"""``torch.sagemaker.moe.moe_config``: not provided."""

from __future__ import annotations

from .._missing import missing

MoEConfig = missing("torch.sagemaker.moe.moe_config.MoEConfig", "SMP's expert-parallel MoE implementation",
                    "train the Hugging Face MoE model as it is, without torch.sagemaker.transform(config=...)")

__all__ = ["MoEConfig"]
