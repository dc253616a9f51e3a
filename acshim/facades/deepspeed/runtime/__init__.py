"""``deepspeed.runtime`` as far as activation checkpointing needs it."""
