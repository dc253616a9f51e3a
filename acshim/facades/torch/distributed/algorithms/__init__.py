"""``torch.distributed.algorithms``: the activation-checkpointing part (``_checkpoint``)."""
