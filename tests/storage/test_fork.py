"""fork after the disk tier was used (issue 16, item 6): a forked child that offloads to disk finishes
with the gradients of the run without offload (it hung forever: the parent's worker threads, Python
and native, do not exist in a child), and parent and child never share a spill file (a child writing
at the offsets its copy of the allocator believed free overwrote the parent's saved tensors).

Real ``fork`` (multiprocessing's 'fork' context, what torch.multiprocessing and DataLoader workers
use on Linux), both I/O paths, and a timeout so that a regression fails instead of hanging."""

from __future__ import annotations

import faulthandler
import multiprocessing
import pickle
import queue as queue_module
import traceback

import pytest
import torch

from acshim.storage import offload
from acshim.testing import seeded, tiny_sequential

TIMEOUT = 60
WIDTH = 64


def _model() -> torch.nn.Module:
    return seeded(lambda: tiny_sequential(3, WIDTH))


def _input(seed: int) -> torch.Tensor:
    return torch.randn(16, WIDTH, generator=torch.Generator().manual_seed(seed))


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _step(model: torch.nn.Module, x: torch.Tensor, scope) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # dropout masks repeat
    with scope:
        loss = model(x).sum()
    loss.backward()
    return _grads(model)


def _in_child(queue, work, *args) -> None:
    faulthandler.dump_traceback_later(TIMEOUT - 10, exit=True)  # a hang shows where, then the child ends
    try:
        torch.set_num_threads(1)  # as DataLoader workers do: GNU OpenMP's thread team does not survive fork
        queue.put(("ok", pickle.dumps(work(*args))))  # plain bytes: no fd-sharing of tensors
    except BaseException:
        queue.put(("error", traceback.format_exc()))


def _run_forked(work, *args):
    """Run ``work(*args)`` in a forked child; its result, or a failure naming a hang or the error."""
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_in_child, args=(queue, work, *args))
    child.start()
    try:
        status, value = queue.get(timeout=TIMEOUT)
    except queue_module.Empty:
        status, value = "hang", f"the forked child did not finish in {TIMEOUT} s"
    finally:
        child.join(5)
        if child.is_alive():
            child.kill()
            child.join()
    assert status == "ok", value
    return pickle.loads(value)


def _child_trains(native: bool | None, directory: str, scope=None) -> dict[str, torch.Tensor]:
    if native is None:  # the reference: no offload (host tier on CPU moves nothing), same thread count
        scope = offload("host", min_bytes=0)
    elif scope is None:
        scope = offload("disk", 0, directory, min_bytes=0, native=native)
    return _step(_model(), _input(1), scope)


@pytest.mark.parametrize("native", [False, True], ids=["python-io", "native-io"])
def test_forked_child_offloads_to_disk_with_exact_gradients(native, disk_dir):
    expected = _run_forked(_child_trains, None, disk_dir)
    parent_scope = offload("disk", 0, disk_dir, min_bytes=0, native=native)
    _step(_model(), _input(0), parent_scope)  # the parent trained a step: pools and engine threads exist
    assert parent_scope.stats.sent_out > 0
    for scope in (None, parent_scope):  # a new scope in the child, and the parent's own (its tier)
        got = _run_forked(_child_trains, native, disk_dir, scope)
        assert got.keys() == expected.keys()
        for name in expected:
            assert torch.equal(got[name], expected[name]), name


def _child_overwrites(native: bool, directory: str, scope, parent_wrote, child_done) -> bool:
    parent_wrote.wait(TIMEOUT)
    _step(_model(), _input(2), scope)  # the parent's scope: its tier, its (inherited) current file
    child_done.set()
    return True


@pytest.mark.parametrize("native", [False, True], ids=["python-io", "native-io"])
def test_parent_and_child_never_share_a_spill_file(native, disk_dir):
    """The parent holds a graph whose tensors are on disk and writes another one after the fork; the
    child then trains with the same scope. The parent's backward must still read its own bytes."""
    model = _model()
    x = _input(0)
    expected = _step(model, x, offload("host", min_bytes=0))
    scope = offload("disk", 0, disk_dir, min_bytes=0, native=native)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    with scope:
        first = model(x).sum()  # alive across the fork
    context = multiprocessing.get_context("fork")
    parent_wrote, child_done = context.Event(), context.Event()
    queue = context.Queue()
    child = context.Process(target=_in_child, args=(queue, _child_overwrites, native, disk_dir, scope,
                                                    parent_wrote, child_done))
    child.start()
    try:
        torch.manual_seed(1)
        with scope:
            second = model(x).sum()  # written after the fork, at offsets the child's copy believes free
        parent_wrote.set()
        status, value = queue.get(timeout=TIMEOUT)
        assert status == "ok", value
        assert child_done.wait(TIMEOUT)
    finally:
        child.join(5)
        if child.is_alive():
            child.kill()
            child.join()
    (first + second).backward()
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter.grad, 2 * expected[name]), name
