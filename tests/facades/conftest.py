"""Fixtures shared by the facade tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture
def fresh_smp(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """SMP v1 process state reset around a test, with no launcher config in the environment."""
    import acshim.facades.smdistributed.modelparallel.torch as smp

    monkeypatch.delenv("SM_HP_MP_PARAMETERS", raising=False)
    smp.state.reset()
    yield
    smp.state.reset()
