"""Which API made a region call: the name ``acshim run --report`` and the ``--budget`` plan give it.

A facade says it; nothing walks the stack to guess. One that builds ``RegionOptions`` itself sets
``RegionOptions.dialect`` (``"deepspeed"``). One that calls ``acshim.checkpoint`` (torch's
``checkpoint_wrapper``, the route of ``torch.utils.checkpoint`` under ``acshim run``) makes the call
inside ``made_by(dialect)``; ``acshim.checkpoint`` takes that name for its region (``claim``) and
clears it for the regions nested inside, which their own callers name. A call nobody names is the
engine's own API: ``ENGINE`` (``"acshim"``). While Dynamo traces, nothing is set (it traces no
context variable, and no report or plan sees a traced region).
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar, Token
from typing import Any

import torch

ENGINE = "acshim"
"""The name of regions made through the engine's own API (``acshim.checkpoint``,
``acshim.apply_checkpointing``, ``acshim.run_region``)."""

_CALLER: ContextVar[str | None] = ContextVar("acshim_region_dialect", default=None)


class _MadeBy(contextlib.AbstractContextManager):
    def __init__(self, dialect: str) -> None:
        self.dialect = dialect
        self.token: Token[str | None] | None = None

    def __enter__(self) -> None:
        self.token = _CALLER.set(self.dialect)

    def __exit__(self, *exc: Any) -> None:
        assert self.token is not None
        _CALLER.reset(self.token)


def made_by(dialect: str) -> contextlib.AbstractContextManager[Any]:
    """A context in which the ``acshim.checkpoint`` call made is ``dialect``'s (a facade wraps its
    call in it), and the wrappers torch's ``checkpoint_wrapper`` facade builds are too."""
    if not isinstance(dialect, str) or not dialect:
        raise TypeError(f"made_by: dialect must be a non-empty name such as 'deepspeed', got {dialect!r}")
    return contextlib.nullcontext() if torch.compiler.is_compiling() else _MadeBy(dialect)


def current() -> str | None:
    """The name ``made_by`` set here, None outside (torch's ``checkpoint_wrapper`` facade names the
    wrappers it builds for another library, e.g. Modalities, with it)."""
    return _CALLER.get()


def claim() -> tuple[str, Token[str | None]]:
    """The name of the region about to run (its facade's, else ``ENGINE``), and the token that
    ``release`` takes back once it has run: the name is cleared for the regions nested inside."""
    token = _CALLER.set(None)
    return token.old_value if isinstance(token.old_value, str) else ENGINE, token


def release(token: Token[str | None]) -> None:
    """Undo ``claim``."""
    _CALLER.reset(token)
