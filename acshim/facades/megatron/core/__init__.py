"""``megatron.core`` as served by acshim: only ``tensor_parallel``'s checkpoint and RNG names."""
