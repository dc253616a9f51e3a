"""Sources of acshim's native offload/prefetch extension (installed as ``acshim._csrc``)."""
