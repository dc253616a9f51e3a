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


def _space_back(tier, disk_dir, spill_in) -> None:
    """Every slot freed: the tier's file truncated to nothing, or closed (a backward the interrupt
    unwound released its graph and closed the file at once, issue 28.2)."""
    assert spill_in(disk_dir) == 0
    assert tier._current is None or (tier._current.live == 0 and os.fstat(tier._current.fd).st_size == 0)


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
def test_ctrl_c_while_a_slot_is_freed_propagates_and_frees_it(prefetch, disk_dir, monkeypatch, ctrl_c_raises,
                                                               spill_in):
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
    _space_back(scope._tier, disk_dir, spill_in)  # every slot of the step freed


@pytest.mark.parametrize("prefetch", [0, 2])
def test_ctrl_c_during_a_backward_node_stops_the_run_and_frees_its_space(prefetch, disk_dir, monkeypatch,
                                                                          ctrl_c_raises, spill_in):
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
    _space_back(scope._tier, disk_dir, spill_in)


# ---------------------------------------------------------------------------------------------
# issue 28.2: an exception unwinding a backward releases every file, slot and copy of its graph at
# once, while the script still holds the graph (a loss kept for logging, a notebook's traceback)


class Interrupted(Exception):
    pass


def _interrupted_step(scope, error: type[BaseException], depth: int = 8):
    """Forward under ``scope``; backward stopped by ``error`` raised from a tensor hook halfway."""
    torch.manual_seed(0)
    x = torch.randn(256, 256, requires_grad=True)
    with scope:
        h = x
        for i in range(depth):
            h = h.exp().tanh()
            if i == depth // 2:
                h.register_hook(lambda grad: (_ for _ in ()).throw(error()))
        loss = h.sum()
    with pytest.raises(error):
        loss.backward()
    return x, loss


@pytest.mark.parametrize("error", [KeyboardInterrupt, Interrupted])
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_an_exception_unwinding_backward_releases_the_graphs_files_at_once(prefetch, error, disk_dir, fds_in,
                                                                            spill_in):
    scope = offload("disk", prefetch, disk_dir, min_bytes=0)
    x, loss = _interrupted_step(scope, error)  # the graph is still held
    assert fds_in(disk_dir) == [] and spill_in(disk_dir) == 0
    # the released tensors are gone: backward through them again is torch's freed-graph error
    with pytest.raises(RuntimeError, match="Trying to backward through the graph a second time"):
        loss.backward()
    del loss
    gc.collect()
    assert REAPER.settle()
    assert fds_in(disk_dir) == []


@pytest.mark.parametrize("storage", ["disk", "host"])
def test_the_next_step_after_an_unwound_backward_is_exact(storage, disk_dir):
    _interrupted_step(offload(storage, 1, disk_dir, min_bytes=0), KeyboardInterrupt)
    torch.manual_seed(0)
    x = torch.randn(256, 256, requires_grad=True)
    _chain(x, 8).backward()
    expected = x.grad.clone()
    x.grad = None
    with offload(storage, 1, disk_dir, min_bytes=0):
        loss = _chain(x, 8)
    loss.backward()
    assert torch.equal(x.grad, expected)


def test_retain_graph_keeps_the_graph_for_another_backward(disk_dir, fds_in):
    """With ``retain_graph=True`` the caller may run backward again: nothing is released."""
    torch.manual_seed(0)
    x = torch.randn(256, 256, requires_grad=True)
    raised = []

    def once(grad):
        if not raised:
            raised.append(True)
            raise KeyboardInterrupt
        return grad

    with offload("disk", 1, disk_dir, min_bytes=0):
        h = x.exp().tanh()
        h.register_hook(once)
        loss = h.exp().tanh().sum()
    with pytest.raises(KeyboardInterrupt):
        loss.backward(retain_graph=True)
    assert fds_in(disk_dir) != []  # still there for the retry
    loss.backward()
    expected = torch.autograd.grad(x.exp().tanh().exp().tanh().sum(), x)[0]
    assert torch.equal(x.grad, expected)


def test_the_backward_entry_wrapper_is_removed_by_uninstall_and_comes_back_with_the_next_scope(disk_dir):
    import torch.autograd.graph as autograd_graph

    import acshim

    _interrupted_step(offload("disk", 1, disk_dir, min_bytes=0), Interrupted)
    assert hasattr(autograd_graph._engine_run_backward, "__acshim_unwind__")
    assert torch.autograd._engine_run_backward is autograd_graph._engine_run_backward
    acshim.uninstall()
    assert not hasattr(autograd_graph._engine_run_backward, "__acshim_unwind__")
    assert torch.autograd._engine_run_backward is autograd_graph._engine_run_backward
    with offload("disk", 1, disk_dir, min_bytes=0):
        loss = _chain(torch.randn(64, 64, requires_grad=True))
    assert hasattr(autograd_graph._engine_run_backward, "__acshim_unwind__")
    loss.backward()
