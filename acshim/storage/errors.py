"""The storage tier's one error type: an I/O failure, said plainly, with what was kept."""

from __future__ import annotations


class OffloadIOError(OSError):
    """A saved tensor could not be written to (or read back from) its storage tier.

    Subclasses ``OSError`` and keeps the original ``errno`` (``errno.ENOSPC`` for a full disk), so
    ``except OSError`` still catches it. Raised in the training step where the failure happened.
    """
