"""``torch.sagemaker.nn``: not provided (SMP's fused attention modules)."""
