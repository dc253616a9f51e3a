"""Parse a memory budget: bytes, a size string ("1.5GiB", "800MB") or a fraction of a reference."""

from __future__ import annotations

import math
import re

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


class BetweenBudget(float):
    """A budget as torch's ``activation_memory_budget`` means it (``torch._functorch.config``, set by
    torchtitan's ``MemoryBudgetAC``): 0.0 is the peak of full recompute (every block recomputed), 1.0
    the peak without checkpointing, linear between. ``acshim.plan`` and ``--budget`` fractions are
    of the peak without checkpointing instead."""

    def __new__(cls, value: float) -> BetweenBudget:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
            raise ValueError(f"memory_budget must be a number in [0, 1] (0: full recompute's activation memory, "
                             f"1: no checkpointing's), got {value!r}")
        return super().__new__(cls, value)

    def __str__(self) -> str:
        return f"memory_budget={float(self)}"

    def between(self, full_recompute: int, none: int) -> int:
        """Bytes: this share of the way from full recompute's peak to no checkpointing's."""
        return max(1, int(full_recompute + float(self) * max(0, none - full_recompute)))


def parse_budget(budget: int | float | str, reference_bytes: int | None = None) -> int:
    """Bytes for ``budget``: an int (bytes), a size string ("1.5GiB", "800MB", "123456"), or a float
    in (0, 1] (or a string such as "0.3") meaning that fraction of ``reference_bytes`` (the step's
    peak activation memory without checkpointing). Raises ``ValueError`` for anything else."""
    if isinstance(budget, BetweenBudget):
        if reference_bytes is None:
            raise ValueError("a fractional budget needs the reference activation memory")
        return budget.between(reference_bytes, reference_bytes)  # one reference: see BetweenBudget.between
    if isinstance(budget, bool):
        raise TypeError(f"budget must be bytes, a size string or a fraction, got {budget!r}")
    if isinstance(budget, str):
        match = _SIZE.match(budget)
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot parse budget {budget!r}; use bytes (123456), a size ('1.5GiB', '800MB') "
                             "or a fraction of the memory without checkpointing ('0.3')")
        number, unit = float(match.group(1)), match.group(2).lower()
        if unit == "" and ("." in match.group(1) or "e" in match.group(1).lower()):
            return parse_budget(number, reference_bytes)  # a fraction (a float above 1 is refused there)
        budget = number * _UNITS[unit]
        if budget <= 0 or not math.isfinite(budget):
            raise ValueError(f"budget must be positive, got {budget!r}")
        return int(budget)
    if isinstance(budget, int):
        if budget <= 0:
            raise ValueError(f"budget must be positive, got {budget} bytes")
        return budget
    if isinstance(budget, float):
        if not math.isfinite(budget) or budget <= 0:
            raise ValueError(f"budget must be positive, got {budget!r}")
        if budget > 1:
            raise ValueError(f"a float budget is a fraction in (0, 1] of the memory without checkpointing, got "
                             f"{budget!r}; pass bytes as an int or a string such as '1.5GiB'")
        if reference_bytes is None:
            raise ValueError("a fractional budget needs the reference activation memory")
        return max(1, int(budget * reference_bytes))
    raise TypeError(f"budget must be bytes, a size string or a fraction, got {type(budget).__name__}")


def format_bytes(size: float) -> str:
    """``size`` as MiB/GiB text."""
    if abs(size) >= 2**30:
        return f"{size / 2**30:.2f} GiB"
    return f"{size / 2**20:.1f} MiB"


def budget_at_least(size: int) -> str:
    """The shortest ``--budget`` text that is at least ``size`` bytes ("0.8MiB", "1.26GiB"): a hint
    must not round a minimum down below itself."""
    if size >= 2**30:
        return f"{math.ceil(size / 2**30 * 100) / 100:.2f}GiB"
    return f"{math.ceil(size / 2**20 * 10) / 10:.1f}MiB"


def budget_fraction(budget: int | float | str) -> float | None:
    """The fraction a budget is, or None for bytes."""
    try:
        parse_budget(budget, None)
    except ValueError as error:
        if "needs the reference" in str(error):
            return float(budget)
        raise
    return None


def check_budget(budget: object) -> None:
    """ValueError naming ``--budget`` unless ``budget`` is a size, a byte count or a fraction."""
    try:
        parse_budget(budget, 1)
    except (TypeError, ValueError) as error:
        raise ValueError(f"--budget {budget}: {error}") from None
