"""``torch.sagemaker.moe``: not provided (SMP's expert-parallel mixture of experts)."""
