"""The engine's region: recompute semantics, structures, RNG, autocast, BatchNorm, state flags."""

from __future__ import annotations

import dataclasses
from collections import namedtuple

import pytest
import torch
from torch import nn

import acshim
from acshim.testing import ConvBNNet, assert_bitwise_equal, seeded, train_step

MODES = [pytest.param(False, id="non_reentrant"), pytest.param(True, id="reentrant")]


class CountingMLP(nn.Module):
    """Counts forward calls and records the engine's state flags at each call."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(8, 16), nn.Linear(16, 8), nn.Dropout(0.5)
        self.calls: list[tuple[bool, bool]] = []

    def forward(self, x: torch.Tensor, scale: float = 1.0, *, shift: torch.Tensor | None = None) -> torch.Tensor:
        self.calls.append((acshim.is_checkpointing(), acshim.is_recomputing()))
        h = self.drop(torch.relu(self.fc1(x))) * scale
        if shift is not None:
            h = h + shift
        return self.fc2(h)


@pytest.mark.parametrize("reentrant", MODES)
def test_region_recomputes_once_and_exposes_state_flags(reentrant: bool) -> None:
    module = seeded(CountingMLP)
    x = torch.randn(4, 8, requires_grad=True)
    out = acshim.run_region(module, (x,), {}, acshim.RegionOptions(reentrant=reentrant))
    assert module.calls == [(True, False)]
    out.sum().backward()
    assert module.calls == [(True, False), (False, True)]
    assert not acshim.is_checkpointing() and not acshim.is_recomputing()


@pytest.mark.parametrize("reentrant", MODES)
def test_dropout_gradients_bitwise_equal_with_kwargs(reentrant: bool) -> None:
    x = torch.randn(4, 8)
    shift = torch.randn(4, 16, requires_grad=True)

    def step(checkpointed: bool) -> dict[str, torch.Tensor]:
        module = seeded(CountingMLP)
        inp, sh = x.clone().requires_grad_(), shift.detach().clone().requires_grad_()
        torch.manual_seed(3)
        if checkpointed:
            out = acshim.run_region(module, (inp, 0.5), {"shift": sh}, acshim.RegionOptions(reentrant=reentrant))
        else:
            out = module(inp, 0.5, shift=sh)
        out.pow(2).sum().backward()
        grads = {f"grad:{n}": p.grad for n, p in module.named_parameters()}
        return {**grads, "grad:x": inp.grad, "grad:shift": sh.grad}

    assert_bitwise_equal(step(False), step(True))


def test_drop_in_rejects_kwargs_with_reentrant() -> None:
    with pytest.raises(ValueError, match=r"Unexpected keyword arguments: shift.*use_reentrant=False"):
        acshim.checkpoint(CountingMLP(), torch.randn(2, 8), use_reentrant=True, shift=torch.zeros(2, 16))


def test_drop_in_rejects_context_fn_with_reentrant_and_bad_determinism_check() -> None:
    def ctx():
        return torch.utils.checkpoint.noop_context_fn()

    with pytest.raises(ValueError, match="only supported when use_reentrant=False"):
        acshim.checkpoint(torch.sin, torch.randn(2), use_reentrant=True, context_fn=ctx)
    with pytest.raises(ValueError, match=r"determinism_check should be one of \['default', 'none'\]"):
        acshim.checkpoint(torch.sin, torch.randn(2), determinism_check="strict")
    with pytest.raises(TypeError, match="needs a callable"):
        acshim.checkpoint(3, torch.randn(2))
    with pytest.raises(TypeError, match="preserve_rng_state must be True or False"):
        acshim.checkpoint(torch.sin, torch.randn(2), preserve_rng_state="yes")


def test_determinism_mismatch_raises_checkpoint_error_with_debug_tip() -> None:
    calls = []

    def shape_changes_on_recompute(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        y = x if len(calls) == 1 else torch.cat([x, x])
        return (y.sin() * 2).sum()

    out = acshim.checkpoint(shape_changes_on_recompute, torch.randn(3, requires_grad=True))
    with pytest.raises(torch.utils.checkpoint.CheckpointError, match="debug=True"):
        out.backward()


@dataclasses.dataclass
class Pair:
    left: torch.Tensor
    right: torch.Tensor
    label: str = "pair"


Point = namedtuple("Point", ["x", "y"])


@pytest.mark.parametrize("reentrant", MODES)
def test_nested_inputs_and_outputs_keep_structure_and_get_gradients(reentrant: bool) -> None:
    a, b, c = (torch.randn(3, requires_grad=True) for _ in range(3))

    def fn(pair: Pair, items: list, mapping: dict) -> dict:
        return {"pair": Pair(pair.left * 2, pair.right.sin(), pair.label + "!"),
                "point": Point(items[0].cos(), items[1]),
                "scaled": [mapping["t"] * mapping["k"]], "tag": mapping["tag"]}

    tag = object()
    out = acshim.run_region(fn, (Pair(a, b), [c, 7], {"t": a, "k": 3.0, "tag": tag}), {},
                            acshim.RegionOptions(reentrant=reentrant))
    assert isinstance(out["pair"], Pair) and out["pair"].label == "pair!"
    assert isinstance(out["point"], Point) and out["point"].y == 7
    assert out["tag"] is tag
    loss = out["pair"].left.sum() + out["pair"].right.sum() + out["point"].x.sum() + out["scaled"][0].sum()
    loss.backward()
    assert torch.equal(a.grad, torch.full((3,), 5.0))
    assert torch.equal(b.grad, b.detach().cos())
    assert torch.equal(c.grad, -c.detach().sin())


@pytest.mark.parametrize("reentrant", MODES)
def test_model_output_is_rebuilt(reentrant: bool) -> None:
    transformers = pytest.importorskip("transformers")
    x = torch.randn(2, 3, requires_grad=True)

    def fn(t: torch.Tensor) -> transformers.modeling_outputs.BaseModelOutput:
        return transformers.modeling_outputs.BaseModelOutput(last_hidden_state=t * 3)

    out = acshim.run_region(fn, (x,), {}, acshim.RegionOptions(reentrant=reentrant))
    assert type(out).__name__ == "BaseModelOutput" and out[0] is out.last_hidden_state
    out.last_hidden_state.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0))


@pytest.mark.parametrize("reentrant", MODES)
def test_parameters_get_gradients_when_no_input_requires_grad(reentrant: bool) -> None:
    reference = seeded(lambda: nn.Linear(4, 4))
    module = seeded(lambda: nn.Linear(4, 4))
    x = torch.randn(2, 4)
    reference(x).sum().backward()
    acshim.run_region(module, (x,), {}, acshim.RegionOptions(reentrant=reentrant)).sum().backward()
    assert torch.equal(module.weight.grad, reference.weight.grad)
    assert torch.equal(module.bias.grad, reference.bias.grad)


class TrackedDropout(nn.Module):
    """Megatron-style: dropout drawn from a named tracker stream."""

    def __init__(self, tracker: acshim.RNGStatesTracker) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.tracker = tracker

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.tracker.fork():
            x = nn.functional.dropout(self.fc(x), 0.5, training=True)
        return x


@pytest.mark.parametrize("reentrant", MODES)
def test_tracker_streams_are_restored_for_the_recompute(reentrant: bool) -> None:
    x = torch.randn(4, 8)

    def step(checkpointed: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        tracker = acshim.RNGStatesTracker(device_type="cpu")
        tracker.add("model-parallel-rng", 1234)
        module = seeded(lambda: TrackedDropout(tracker))
        torch.manual_seed(5)
        inp = x.clone().requires_grad_()
        out = acshim.run_region(module, (inp,), {}, acshim.RegionOptions(reentrant=reentrant)) if checkpointed \
            else module(inp)
        # a draw between forward and backward moves the tracker stream on: the recompute must not see it
        with tracker.fork():
            torch.rand(3)
        out.sum().backward()
        grads = {"grad:w": module.fc.weight.grad, "grad:x": inp.grad}
        return grads, tracker.get_states()["model-parallel-rng"]

    plain, plain_state = step(False)
    checkpointed, state_after = step(True)
    assert_bitwise_equal(plain, checkpointed)
    assert torch.equal(plain_state, state_after)


def test_tracker_errors_match_megatron_wording() -> None:
    tracker = acshim.RNGStatesTracker(device_type="cpu")
    tracker.add("a", 1)
    with pytest.raises(Exception, match="seed 1 already exists"):
        tracker.add("b", 1)
    with pytest.raises(Exception, match="cuda rng state a already exists"):
        tracker.add("a", 2)
    assert 2 in tracker.seeds_  # the seed is consumed before the name check, as upstream
    with pytest.raises(Exception, match="cuda rng state missing is not added"):
        with tracker.fork("missing"):
            pass


@pytest.mark.parametrize("reentrant", MODES)
def test_autocast_dtype_is_kept_for_the_recompute(reentrant: bool) -> None:
    x = torch.randn(4, 8)
    dtypes: list[torch.dtype] = []

    def step(checkpointed: bool) -> dict[str, torch.Tensor]:
        module = seeded(lambda: nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)))
        module[0].register_forward_hook(lambda m, a, o: dtypes.append(o.dtype))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = acshim.run_region(module, (x,), {}, acshim.RegionOptions(reentrant=reentrant)) if checkpointed \
                else module(x)
        out.float().sum().backward()
        return {f"grad:{n}": p.grad for n, p in module.named_parameters()}

    assert_bitwise_equal(step(False), step(True))
    assert dtypes == [torch.bfloat16] * 3  # plain forward, checkpointed forward, recompute


@pytest.mark.parametrize("reentrant", MODES)
def test_batchnorm_statistics_update_once_per_step(reentrant: bool) -> None:
    x = torch.randn(4, 3, 8, 8)
    plain = train_step(seeded(ConvBNNet), x)
    model = seeded(ConvBNNet)
    acshim.apply_checkpointing(model, reentrant=reentrant)
    checkpointed = train_step(model, x)
    assert_bitwise_equal(plain, checkpointed)
    assert checkpointed["buffer:blocks.0.1.num_batches_tracked"].item() == 1
    assert not torch.nn.modules.module._global_forward_pre_hooks  # the recompute guard is gone


def test_no_grad_and_disable_checkpointing_are_plain_calls() -> None:
    module = CountingMLP()
    x = torch.randn(2, 8, requires_grad=True)
    with torch.no_grad():
        acshim.checkpoint(module, x)
    with acshim.disable_checkpointing():
        out = acshim.checkpoint(module, x)
    out.sum().backward()
    assert module.calls == [(False, False), (False, False)]


def test_reentrant_region_rejects_autograd_grad_with_torch_wording() -> None:
    x = torch.randn(3, requires_grad=True)
    out = acshim.checkpoint(torch.sin, x, use_reentrant=True)
    with pytest.raises(RuntimeError, match=r"incompatible with \.grad\(\)"):
        torch.autograd.grad(out.sum(), x)


def test_non_reentrant_region_supports_autograd_grad() -> None:
    x = torch.randn(3, requires_grad=True)
    (grad,) = torch.autograd.grad(acshim.checkpoint(torch.sin, x).sum(), x)
    assert torch.equal(grad, x.detach().cos())


def test_frozen_module_without_grad_inputs_is_not_recomputed() -> None:
    module = CountingMLP()
    module.requires_grad_(False)
    trainable = nn.Linear(8, 8)
    x = torch.randn(2, 8)
    out = acshim.run_region(module, (x,), {}, acshim.RegionOptions(reentrant=True))
    assert not out.requires_grad
    trainable(out).sum().backward()
    assert module.calls == [(True, False)]  # forward only: nothing below needs gradients


def test_reentrant_region_returning_a_preexisting_tensor_does_not_recurse() -> None:
    constant = torch.randn(3)
    x = torch.randn(3, requires_grad=True)
    out, same = acshim.run_region(lambda a: (a.sin(), constant), (x,), {}, acshim.RegionOptions(reentrant=True))
    out.sum().backward()
    assert torch.equal(x.grad, x.detach().cos())
    assert constant.grad_fn is None and torch.equal(same, constant)


class RecordingObserver:
    def __init__(self) -> None:
        self.events: list[str] = []

    def __getattr__(self, name: str):
        return lambda region: self.events.append(name)


@pytest.mark.parametrize("reentrant", MODES)
def test_observer_sees_every_event_even_when_the_recompute_stops_early(reentrant: bool) -> None:
    observer = RecordingObserver()

    def work_after_last_saved_tensor(x: torch.Tensor) -> torch.Tensor:
        y = x.sin()
        return y + 1  # saves nothing: early stop ends the recompute right after sin

    out = acshim.run_region(work_after_last_saved_tensor, (torch.randn(3, requires_grad=True),), {},
                            acshim.RegionOptions(reentrant=reentrant, observer=observer))
    out.sum().backward()
    expected = ["forward_start", "forward_end", "recompute_start", "recompute_end"]
    assert observer.events == expected + (["backward_end"] if reentrant else [])


def test_facade_can_set_the_grad_error_wording() -> None:
    x = torch.randn(3, requires_grad=True)
    options = acshim.RegionOptions(reentrant=True, grad_error_message="Checkpointing is not compatible with .grad()")
    out = acshim.run_region(torch.sin, (x,), {}, options)
    with pytest.raises(RuntimeError, match=r"^Checkpointing is not compatible with \.grad\(\)$"):
        torch.autograd.grad(out.sum(), x)


@pytest.mark.parametrize("reentrant", MODES)
def test_global_module_hook_only_for_regions_whose_modules_are_unknown(reentrant: bool) -> None:
    """A region's modules are found from its callable (the module, a closure's cells); only a
    callable hiding them gets the global forward pre-hook (it slows every module call) while its
    forward runs, and its BatchNorm statistics are still updated once."""
    seen: list[int] = []

    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.bn = nn.BatchNorm1d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(len(torch.nn.modules.module._global_forward_pre_hooks))
            return self.bn(self.fc(x))

    class Hidden:
        """A callable object keeping its module where no search looks."""

        def __init__(self, module: nn.Module) -> None:
            self._held = {"module": module}

        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            return self._held["module"](x)

    x = torch.randn(3, 4)
    for wrap, hooked in ((lambda m: m, 0), (lambda m: (lambda t: m(t)), 0), (Hidden, 1)):
        module = Probe()
        plain = Probe()
        plain.load_state_dict(module.state_dict())
        plain(x).sum().backward()
        seen.clear()
        acshim.run_region(wrap(module), (x,), {}, acshim.RegionOptions(reentrant=reentrant)).sum().backward()
        assert seen == [hooked, 0]  # forward, recompute
        assert all(torch.equal(a, b) for a, b in zip(plain.buffers(), module.buffers()))


def test_region_state_is_one_object_behind_the_public_names() -> None:
    """``acshim.region.STATS`` / ``ROUTERS`` are ``REGION_STATE``'s own objects, and ``reset()``
    clears them in place, so code holding the public names sees the reset."""
    from acshim import region
    from acshim.region_call import REGION_STATE, RegionState

    assert region.STATS is REGION_STATE.stats and region.ROUTERS is REGION_STATE.routers
    local = RegionState()
    stats, routers = local.stats, local.routers
    stats.forwards, stats.recomputes, stats.recorder = 3, 2, object()
    routers.append(object())
    local.reset()
    assert local.stats is stats and local.routers is routers
    assert (stats.forwards, stats.recomputes, stats.recorder, routers) == (0, 0, None, [])
    before = region.STATS.forwards, region.STATS.recomputes
    layer = nn.Linear(4, 4)
    acshim.checkpoint(layer, torch.randn(2, 4, requires_grad=True), use_reentrant=False).sum().backward()
    assert (region.STATS.forwards, region.STATS.recomputes) == (before[0] + 1, before[1] + 1)
