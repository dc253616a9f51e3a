"""Facade of ``smdistributed.modelparallel.torch.patches`` (only ``checkpoint`` is provided)."""
