"""``torch.sagemaker.nn.attn``: not provided (SMP's FlashAttention modules)."""

from __future__ import annotations

from .._missing import missing

_INSTEAD = "use the model's own attention (e.g. attn_implementation='sdpa')"
FlashSelfAttention = missing("torch.sagemaker.nn.attn.FlashSelfAttention", "SMP's FlashAttention module", _INSTEAD)
FlashGroupedQueryAttention = missing("torch.sagemaker.nn.attn.FlashGroupedQueryAttention",
                                     "SMP's grouped-query FlashAttention module", _INSTEAD)

__all__ = ["FlashGroupedQueryAttention", "FlashSelfAttention"]
