"""``torch.sagemaker.utils``."""
