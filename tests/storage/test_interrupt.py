"""Ctrl-C during a disk-offload backward stops the run, as it does without offload, and the space of
the interrupted step comes back (issue 8, item 6). Python swallows exceptions raised in
garbage-collector callbacks, so no slot may be freed by Python code run there."""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import time

import pytest
import torch

from acshim.storage import offload
from acshim.storage.disk import DiskTier
from acshim.storage.reaper import REAPER


def _chain(x: torch.Tensor, depth: int = 6) -> torch.Tensor:
    for _ in range(depth):
        x = x.exp().tanh()
    return x.sum()


@pytest.fixture
def ctrl_c_raises():
    """SIGINT raises KeyboardInterrupt (Python's default), whatever the test runner installed.
    Earlier tests' garbage is collected first: finalizers of other libraries (a dead thread pool's
    weakref callback) would swallow the interrupt in their own Python code."""
    gc.collect()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _step(scope, unraisable):
    x = torch.randn(64, 64, requires_grad=True)
    with scope:
        loss = _chain(x)
    loss.backward()
    del loss
    gc.collect()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # the interrupt lands here at the latest
        time.sleep(0.01)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_ctrl_c_while_a_slot_is_freed_propagates_and_frees_it(prefetch, disk_dir, monkeypatch, ctrl_c_raises):
    real_free = DiskTier.free
    signalled = []

    def free_with_ctrl_c(self, slot):
        if not signalled:
            signalled.append(True)
            os.kill(os.getpid(), signal.SIGINT)  # the user presses Ctrl-C as this slot is freed
        real_free(self, slot)

    monkeypatch.setattr(DiskTier, "free", free_with_ctrl_c)
    swallowed = []
    monkeypatch.setattr(sys, "unraisablehook", swallowed.append)
    scope = offload("disk", prefetch, disk_dir, min_bytes=0)
    with pytest.raises(KeyboardInterrupt):
        _step(scope, swallowed)
    assert signalled and swallowed == [], [(hook.exc_type, hook.object) for hook in swallowed]
    gc.collect()
    assert REAPER.settle()
    tier = scope._tier
    assert tier._current is not None and tier._current.live == 0
    assert os.fstat(tier._current.fd).st_size == 0  # every slot of the step freed


@pytest.mark.parametrize("prefetch", [0, 2])
def test_ctrl_c_during_a_backward_node_stops_the_run_and_frees_its_space(prefetch, disk_dir, monkeypatch,
                                                                          ctrl_c_raises):
    """A real SIGINT arriving while backward computes a node that saved offloaded tensors: the next
    Python code the main thread runs used to be the finalizer freeing those tensors' slots."""
    swallowed = []
    monkeypatch.setattr(sys, "unraisablehook", swallowed.append)
    scope = offload("disk", prefetch, disk_dir, min_bytes=0)
    a = torch.randn(1200, 1200, requires_grad=True)
    b = torch.randn(1200, 1200, requires_grad=True)
    pressed = []

    def press_ctrl_c_soon(grad):  # runs just before MmBackward: the signal lands during its matmuls
        timer = threading.Timer(0.02, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        pressed.append(timer)
        return grad

    def step():
        with scope:
            y = (a * 1) @ (b * 1)
            y.register_hook(press_ctrl_c_soon)
            loss = y.tanh().sum()
        loss.backward()
        del loss, y
        gc.collect()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # the interrupt lands here at the latest
            time.sleep(0.01)

    with pytest.raises(KeyboardInterrupt):
        step()
    pressed[0].join()
    assert swallowed == [], [(hook.exc_type, hook.object) for hook in swallowed]
    gc.collect()
    assert REAPER.settle()
    tier = scope._tier
    assert tier._current is not None and tier._current.live == 0
    assert os.fstat(tier._current.fd).st_size == 0
