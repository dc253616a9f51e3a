"""A saved tensor changed in place before backward: under every tier and prefetch horizon the run
raises torch's own error, word for word, as the run without offload does (issue 8, item 1). Torch
skips its version check when saved-tensor hooks are active, so the storage tier must do it, for
tensors kept in place, moved ones, resident ones and ones already prefetched back. Tests taking
``runtime`` also run on the CUDA backend over the simulated CUDA runtime (see conftest)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import acshim
from acshim.options import RegionOptions
from acshim.storage import boundary_offload, no_offload, offload
from acshim.storage.versions import forward_op_name

TIERS = [("host", 0), ("host", 2), ("disk", 0), ("disk", 1), ("disk", 2), ("disk", 8)]


def _outcome(run):
    """The error text of ``run()``, or its gradients if it raised none."""
    try:
        return ("grads", run())
    except RuntimeError as error:
        return ("error", str(error))


def _scope(storage, prefetch, directory):
    return offload(storage, prefetch, directory if storage == "disk" else None, min_bytes=0)


def _input_changed(scope):
    x = torch.randn(32, 32, requires_grad=True)
    h = x * 1
    with scope:
        y = h.sin()
    with torch.no_grad():
        h.add_(1)
    y.sum().backward()
    return x.grad


def _output_changed(scope):
    x = torch.randn(4, 32, requires_grad=True)
    with scope:
        y = x.exp()  # exp saves its own output
    with torch.no_grad():
        y.mul_(2)
    y.sum().backward()
    return x.grad


def _parameter_changed(scope):
    layer = nn.Linear(32, 32)
    x = torch.randn(8, 32, requires_grad=True)
    with scope:
        loss = layer(x).square().sum()
    with torch.no_grad():
        layer.weight.add_(0.1)  # an optimizer step before backward: the weight is kept by reference
    loss.backward()
    return x.grad


def _changed_with_grad(scope):
    x = torch.randn(32, 32, requires_grad=True)
    h = x + 1
    with scope:
        y = h.sin()
    h.mul_(3)  # grad mode: torch names h's new grad_fn (Mul, not Add)
    y.sum().backward()
    return x.grad


def _double_changed(scope):
    x = torch.randn(32, 32, dtype=torch.float64, requires_grad=True)
    h = x * 1
    with scope:
        y = (h * h).sum()
    with torch.no_grad():
        h.add_(1)
        h.add_(1)
    y.backward()
    return x.grad


def _input_changed_then_freed(scope):
    """The user drops the tensor it changed (issue 16, item 1): only the version counter, which
    outlives the tensor, can tell that the bytes a background copy wrote may postdate the change."""
    x = torch.randn(32, 32, requires_grad=True)
    with scope:
        h = x * 1
        y = h.sin()
    with torch.no_grad():
        h.mul_(2)
    del h
    y.sum().backward()
    return x.grad


def _output_changed_then_freed(scope):
    x = torch.randn(4, 32, requires_grad=True)
    with scope:
        y = x.exp()
        z = y.sum()
    with torch.no_grad():
        y.mul_(2)
    del y
    z.backward()
    return x.grad


def _base_changed_view_saved_then_freed(scope):
    x = torch.randn(32, 32, requires_grad=True)
    with scope:
        h = x * 1
        y = h[8:24].sin()  # saves a view of h
    with torch.no_grad():
        h.add_(1)  # the base changes: so does every view of it
    del h
    y.sum().backward()
    return x.grad


CASES = [_input_changed, _output_changed, _parameter_changed, _changed_with_grad, _double_changed,
         _input_changed_then_freed, _output_changed_then_freed, _base_changed_view_saved_then_freed]


@pytest.mark.parametrize("storage,prefetch", TIERS)
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.__name__.strip("_"))
def test_in_place_change_after_save_raises_torchs_error(case, storage, prefetch, disk_dir, runtime):
    torch.manual_seed(0)
    expected = _outcome(lambda: case(contextlib.nullcontext()))
    assert expected[0] == "error" and "modified by an inplace operation" in expected[1]
    torch.manual_seed(0)
    assert _outcome(lambda: case(_scope(storage, prefetch, disk_dir))) == expected


@pytest.mark.parametrize("storage,prefetch", TIERS)
def test_inside_no_offload_too(storage, prefetch, disk_dir, runtime):
    def case(scope):
        with scope, no_offload():
            return _input_changed(contextlib.nullcontext())

    expected = _outcome(lambda: _input_changed(contextlib.nullcontext()))
    assert _outcome(lambda: case(_scope(storage, prefetch, disk_dir))) == expected
    with no_offload():  # alone, too: its hooks must not switch torch's check off
        assert _outcome(lambda: _input_changed(contextlib.nullcontext())) == expected


@pytest.mark.parametrize("prefetch", [1, 2, 3])
def test_change_after_the_prefetch_copied_the_tensor_back(prefetch, disk_dir, runtime):
    """The copy in was issued (and may have landed) before the edit: only the version tells."""
    seen_fetched = []

    def run(scope):
        x = torch.randn(32, 32, requires_grad=True)
        h = x * 1
        with scope:
            a = h.sin()  # saves h: the first group, the last one backward needs
            b = a.exp()
            for _ in range(6):
                b = b.exp().tanh()
        session = getattr(scope, "session", None)

        def edit(grad):
            if session is not None:
                seen_fetched.append(any(record.group == 0 for record in session.scheduler.fetches))
            with torch.no_grad():
                h.add_(1)
            return grad

        a.register_hook(edit)  # runs after a's consumers, before SinBackward unpacks h
        b.sum().backward()
        return x.grad

    expected = _outcome(lambda: run(contextlib.nullcontext()))
    assert expected[0] == "error"
    assert _outcome(lambda: run(offload("disk", prefetch, disk_dir, min_bytes=0))) == expected
    assert seen_fetched == [True]  # h's copy in had been issued before the edit


@pytest.mark.parametrize("freed", [False, True], ids=["kept", "freed"])
@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("storage,prefetch", [("host", 2), ("disk", 0), ("disk", 2)])
def test_region_boundary_inputs_changed_in_place(reentrant, storage, prefetch, freed, disk_dir, runtime):
    block = nn.Sequential(nn.Linear(32, 32), nn.Tanh())

    def run(scope):
        options = RegionOptions(reentrant=reentrant, saved_tensors_scope=scope)
        x = torch.randn(8, 32, requires_grad=True)
        h = x * 1
        y = acshim.run_region(block, (h,), {}, options)
        with torch.no_grad():
            h.add_(1)
        if freed:
            del h
        y.sum().backward()
        return x.grad

    torch.manual_seed(0)
    expected = _outcome(lambda: run(None))
    torch.manual_seed(0)
    got = _outcome(lambda: run(boundary_offload(storage, prefetch, disk_dir if storage == "disk" else None,
                                                min_bytes=0)))
    assert got[0] == expected[0]
    if expected[0] == "error":
        assert got == expected
    else:
        assert torch.equal(got[1], expected[1])


@pytest.mark.parametrize("storage,prefetch", TIERS)
def test_unchanged_tensors_still_give_bitwise_equal_gradients(storage, prefetch, disk_dir, runtime):
    """The check costs nothing in correctness: same version, same gradients as without offload."""

    def run(scope):
        torch.manual_seed(0)
        x = torch.randn(32, 32, requires_grad=True)
        h = x * 1
        with scope:
            y = h.sin().exp().tanh()
        h2 = h + 1  # out-of-place: no version change
        (y.sum() + h2.sum()).backward()
        return x.grad

    expected = run(contextlib.nullcontext())
    assert torch.equal(run(_scope(storage, prefetch, disk_dir)), expected)


def test_node_names_are_shortened_as_torch_does():
    assert forward_op_name("ExpBackward0") == "Exp"
    assert forward_op_name("AddBackward1") == "Add1"
    assert forward_op_name("MyFunctionBackward") == "MyFunction"
    assert forward_op_name("torch::autograd::CopyBackwards") == "torch::autograd::CopyBackwards"
    assert forward_op_name("torch::autograd::AccumulateGrad") == "torch::autograd::AccumulateGrad"


def test_message_under_anomaly_mode_is_torchs_too(disk_dir):
    with torch.autograd.set_detect_anomaly(True), pytest.warns(UserWarning):
        expected = _outcome(lambda: _input_changed(contextlib.nullcontext()))
        got = _outcome(lambda: _input_changed(_scope("disk", 2, disk_dir)))
    assert "Good luck" in expected[1] and got == expected


def test_the_version_probe_is_invisible_to_dispatch_modes_and_still_sees_changes():
    """On an H100, the CUDA sanitizer (a dispatch mode) took the probe's ``set_`` for a write of the
    saved tensor's bytes, racing the copy out; the probe touches no byte and no mode should see it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from acshim.storage.versions import version_probe

    seen = []

    class Recording(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    tensor = torch.randn(4, requires_grad=True) * 2
    with Recording():
        probe = version_probe(tensor)
    assert probe is not None and seen == []
    assert probe.untyped_storage().nbytes() == 0 and probe._version == tensor._version
    tensor.view(2, 2).mul_(2)  # a change through a view
    assert probe._version == tensor._version > 0
