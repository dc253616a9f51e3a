"""``modalities.training``: the activation-checkpointing part."""
