"""Offload options a user sets without editing the script (``ACSHIM_OFFLOAD_STORAGE=disk acshim run
train.py``): read by facades whose upstream API has no storage argument (torchtune's and DeepSpeed's
activation offload). ``ACSHIM_OFFLOAD_DIR`` names the disk tier's directory."""

from __future__ import annotations

import os

STORAGE_VARIABLE = "ACSHIM_OFFLOAD_STORAGE"
DIRECTORY_VARIABLE = "ACSHIM_OFFLOAD_DIR"


def offload_storage(storage: str | None = None, directory: str | None = None) -> tuple[str | None, str | None]:
    """``(storage, directory)``: the arguments when given, else the environment's, else None (the
    engine defaults, ``acshim.storage.set_defaults``)."""
    if storage is None:
        storage = os.environ.get(STORAGE_VARIABLE) or None
    if directory is None:
        directory = os.environ.get(DIRECTORY_VARIABLE) or None
    return storage, directory
