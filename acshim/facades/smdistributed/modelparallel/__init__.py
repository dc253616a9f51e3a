"""Facade of ``smdistributed.modelparallel``: only the PyTorch flavour (``.torch``) is provided."""
