"""``acshim run --report``'s observers are undone as ``uninstall()`` undoes the patches: the recorder,
the storage tier's session observers, and the facades' diagnostics watchers (DeepSpeed's
``initialize`` wrapper), with the per-thread ``no_offload`` count kept in ``acshim.state``."""

from __future__ import annotations

import sys
import threading
import types

import pytest
import torch

from acshim import report
from acshim.diagnostics import DIAGNOSTICS
from acshim.patching import uninstall
from acshim.region import STATS
from acshim.state import state
from acshim.storage import no_offload, offload, recording
from acshim.storage.observers import SESSION_OBSERVERS


@pytest.fixture
def fake_deepspeed(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """A ``deepspeed`` module already imported (the watcher wraps it at once)."""
    module = types.ModuleType("deepspeed")

    def initialize(*args: object, **kwargs: object) -> str:
        return "engine"

    module.initialize = initialize  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "deepspeed", module)
    yield module
    report.stop()


def test_report_start_is_undone_by_uninstall(fake_deepspeed: types.ModuleType) -> None:
    original = fake_deepspeed.initialize
    recorder = report.start()
    assert report.start() is recorder  # idempotent
    assert STATS.recorder is recorder and len(SESSION_OBSERVERS) == 1
    assert fake_deepspeed.initialize is not original  # watched: DeepSpeed's config block is noted
    assert fake_deepspeed.initialize(config={"activation_checkpointing": {}}) == "engine"
    uninstall()
    assert len(SESSION_OBSERVERS) == 0 and not DIAGNOSTICS.watching
    assert fake_deepspeed.initialize is original
    assert STATS.recorder is recorder  # region state, like the counts: report.stop() drops it
    assert report.start() is recorder and len(SESSION_OBSERVERS) == 1  # hooked up again
    assert fake_deepspeed.initialize is not original
    report.stop()
    assert STATS.recorder is None and fake_deepspeed.initialize is original


def test_report_stop_undoes_start(fake_deepspeed: types.ModuleType) -> None:
    original = fake_deepspeed.initialize
    report.start()
    report.stop()
    assert STATS.recorder is None and len(SESSION_OBSERVERS) == 0
    assert fake_deepspeed.initialize is original


def test_recorder_sees_offload_sessions_until_uninstall() -> None:
    recorder = report.start()
    try:
        with offload("host", min_bytes=0):
            torch.ones(4, requires_grad=True).exp().sum().backward()
        assert [session.storage for session, _ in recorder.offloads] == ["host"]
        assert recorder.sessions is recorder.offloads  # the former name
        uninstall()
        with offload("host", min_bytes=0):
            torch.ones(4, requires_grad=True).exp().sum().backward()
        assert len(recorder.offloads) == 1  # uninstall() unhooked it from the storage tier
    finally:
        report.stop()


def test_diagnostics_notes_come_from_registered_checks() -> None:
    DIAGNOSTICS.add_check("test-dialect", lambda ran: [] if "test-dialect" in ran else ["test setting does nothing"])
    try:
        recorder = report.RegionRecorder()
        assert "test setting does nothing" in recorder.warnings()
    finally:
        DIAGNOSTICS.add_check("test-dialect", lambda ran: [])


def test_recording_uses_the_observer_registry() -> None:
    with recording() as sessions:
        assert len(SESSION_OBSERVERS) == 1
        with offload("host", min_bytes=0):
            torch.ones(4, requires_grad=True).exp().sum().backward()
    assert len(sessions) == 1 and len(SESSION_OBSERVERS) == 0


def test_no_offload_count_is_per_thread() -> None:
    seen = []
    with no_offload():
        assert state.offload_opt_outs == 1
        thread = threading.Thread(target=lambda: seen.append(state.offload_opt_outs))
        thread.start()
        thread.join()
    assert seen == [0] and state.offload_opt_outs == 0
