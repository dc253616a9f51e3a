"""``modalities.training.activation_checkpointing``: ``activation_checkpointing`` and
``activation_checkpointing_variants``, as upstream lays them out."""
