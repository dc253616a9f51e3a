"""Engine-wide offload defaults that facades write and read (e.g. SMP v2's ``sm_activation_offloading``
and ``activation_loading_horizon`` are written by the SageMaker facade and read by ``offload_wrapper``).

One small frozen dataclass, replaced as a whole; ``offload()`` and ``boundary_offload()`` take each
option they are not given from here.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, replace

STORAGES = ("host", "disk")


@dataclass(frozen=True)
class StorageDefaults:
    """Defaults of every offload option."""

    storage: str = "host"
    """``"host"``: device tensors go to pinned host memory (CPU tensors stay put, free). ``"disk"``:
    tensors go to private files (CPU training, or host-memory relief), slower to bring back."""
    prefetch: int = 2
    """Horizon H: groups (regions, or saved tensors in an ``offload()`` scope) brought back ahead of
    backward, and the most recent H groups are never sent out. More hides slower transfers and holds
    more memory; 0 sends everything out at once and waits for every copy in backward. SMP v2's
    ``activation_loading_horizon`` default is 2."""
    min_bytes: int = 1024
    """Size floor: smaller tensors stay where they are (moving them costs more than it saves)."""
    directory: str | None = None
    """Disk tier: where its private files go (a fresh 0700 directory inside it); None = the system
    temporary directory (``$TMPDIR``)."""

    def __post_init__(self) -> None:
        validate(self.storage, self.prefetch, self.min_bytes)


def validate(storage: str, prefetch: int, min_bytes: int) -> None:
    """Raise ``ValueError`` naming the bad argument and what it accepts."""
    if storage not in STORAGES:
        raise ValueError(f"storage must be one of {STORAGES}, got {storage!r}")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be a non-negative int (the number of groups loaded ahead), got {prefetch!r}")
    if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
        raise ValueError(f"min_bytes must be a non-negative int, got {min_bytes!r}")


def check_directory_argument(directory: object) -> None:
    """``directory`` must be the path (str or ``os.PathLike``) of an existing writable directory."""
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"directory must be a path (str or os.PathLike) or None, got {directory!r}")
    from .disk import check_directory

    check_directory(os.fspath(directory))


def check_flag(name: str, value: object, meaning: str) -> None:
    """``value`` must be True, False or None (``meaning`` says what None does)."""
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{name} must be True, False or None ({meaning}), got {value!r}")


_lock = threading.Lock()
_current = StorageDefaults()


def get_defaults() -> StorageDefaults:
    """The current defaults."""
    return _current


def set_defaults(**changes: object) -> StorageDefaults:
    """Change some defaults (``storage``, ``prefetch``, ``min_bytes``, ``directory``); returns the
    previous ones so a caller can restore them with ``set_defaults(**vars(previous))``.
    Unknown names raise ``TypeError``; bad values ``ValueError``."""
    global _current
    unknown = sorted(set(changes) - set(StorageDefaults.__dataclass_fields__))
    if unknown:
        raise TypeError(f"set_defaults: unknown option(s) {', '.join(unknown)}; known: "
                        f"{', '.join(StorageDefaults.__dataclass_fields__)}")
    if changes.get("directory") is not None:  # checked when given, not each time other defaults change
        check_directory_argument(changes["directory"])
    with _lock:
        previous = _current
        _current = replace(previous, **changes)
        return previous


def reset_defaults() -> None:
    """Back to the built-in defaults (tests)."""
    global _current
    with _lock:
        _current = StorageDefaults()
