"""acshim waits at exit for torch.distributed's Gloo worker threads to go back to sleep (see
acshim/exit_settle.py). A thread given the worker's name stands for one: busy, then asleep."""

from __future__ import annotations

import ctypes
import sys
import threading
import time

import pytest
import torch.distributed  # noqa: F401  (settling applies where torch.distributed is imported)

from acshim.exit_settle import _runloop_states, settle_collective_threads

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="thread states come from /proc")


def _named_worker(busy_seconds: float, stop: threading.Event) -> threading.Thread:
    def run() -> None:
        ctypes.CDLL(None).prctl(15, b"pt_gloo_runloop", 0, 0, 0)  # PR_SET_NAME: this thread's comm
        named.set()
        end = time.monotonic() + busy_seconds
        while time.monotonic() < end:
            pass  # running: a worker still finishing its work
        stop.wait()

    named = threading.Event()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    named.wait()
    return thread


def test_settling_waits_for_a_busy_worker_thread_to_sleep() -> None:
    stop = threading.Event()
    thread = _named_worker(0.3, stop)
    try:
        assert _runloop_states()  # the named thread is seen
        started = time.monotonic()
        assert settle_collective_threads(timeout=5.0)
        assert time.monotonic() - started >= 0.25
    finally:
        stop.set()
        thread.join()


def test_settling_returns_at_once_when_workers_sleep_and_gives_up_at_its_timeout() -> None:
    stop = threading.Event()
    thread = _named_worker(0.0, stop)
    try:
        started = time.monotonic()
        assert settle_collective_threads(timeout=5.0)
        assert time.monotonic() - started < 1.0
    finally:
        stop.set()
        thread.join()
    stop = threading.Event()
    thread = _named_worker(2.0, stop)
    try:
        assert not settle_collective_threads(timeout=0.2)
    finally:
        stop.set()
        thread.join()
