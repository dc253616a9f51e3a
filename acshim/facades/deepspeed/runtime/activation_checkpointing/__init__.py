"""``deepspeed.runtime.activation_checkpointing``: the ``checkpointing`` and ``config`` modules."""
