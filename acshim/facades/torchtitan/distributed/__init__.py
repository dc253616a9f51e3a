"""``torchtitan.distributed`` as far as activation checkpointing needs it."""
