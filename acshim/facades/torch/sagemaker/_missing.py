"""Stand-ins for SMP v2 names that need SMP's own distributed implementation: touching them raises
``NotImplementedError`` saying what is missing and what to use instead."""

from __future__ import annotations

from typing import Any, NoReturn


def missing(name: str, what: str, instead: str) -> type:
    """A class whose construction raises ``NotImplementedError`` for ``name``."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(f"{name}: {what} is not provided by acshim; {instead}")

    return type(name.rsplit(".", 1)[-1], (), {"__init__": __init__, "__doc__": f"Not provided: {what}."})


def missing_function(name: str, what: str, instead: str) -> Any:
    def function(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(f"{name}: {what} is not provided by acshim; {instead}")

    function.__name__ = name.rsplit(".", 1)[-1]
    function.__doc__ = f"Not provided: {what}."
    return function
