"""``modalities.config``: the activation-checkpointing parameter classes only."""
