"""Fixtures the engine's planner tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from acshim import region
from acshim.planner.session import PlanSession


@pytest.fixture
def session_cleanup() -> Iterator[list[PlanSession]]:
    """Sessions a test starts (append them): stopped after it, leaving no router installed."""
    sessions: list[PlanSession] = []
    yield sessions
    for session in sessions:
        session.stop()
    assert region.ROUTERS == []
