"""``torch.sagemaker.distributed.checkpoint``: not provided (SMP's sharded checkpoint saver/loader)."""
