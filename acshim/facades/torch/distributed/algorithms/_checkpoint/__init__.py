"""``torch.distributed.algorithms._checkpoint``: ``checkpoint_wrapper`` on the acshim engine."""
