"""Bad arguments to the public entry points fail at the call, naming the argument, and change nothing
(issue 8 item 9): no region installed, no default replaced, no facade state touched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import acshim
import acshim.storage as storage
from acshim.testing import GPT


def snapshot(model: torch.nn.Module) -> list:
    """What checkpointing could change on a model: each module's instance forward and options."""
    return [(name, module.__dict__.get("forward"), getattr(module.__dict__.get("forward"), "options", None))
            for name, module in model.named_modules()]


def small_gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(vocab=32, width=16, layers=4, heads=2, seq=8)


BAD_OPTIONS = [
    ({"determinism_check": "bogus"}, ValueError, r"determinism_check should be one of \['default', 'none'\], but got bogus"),
    ({"context_fn": "abc"}, TypeError, r"context_fn must be a function returning a \(forward, recompute\) pair"),
    ({"preserve_rng_state": "x"}, TypeError, r"preserve_rng_state must be True or False, got 'x'"),
    ({"reentrant": "yes"}, TypeError, r"reentrant must be True or False"),
    ({"debug": 1}, TypeError, r"debug must be True or False"),
    ({"early_stop": None}, TypeError, r"early_stop must be True or False"),
    ({"saved_tensors_scope": "host"}, TypeError, r"saved_tensors_scope must be a function returning"),
    ({"reentrant": True, "context_fn": acshim.selective.save_ops()}, ValueError,
     r"Passing context_fn or debug is only supported when use_reentrant=False"),
    ({"reentrant": True, "debug": True}, ValueError, r"Passing context_fn or debug is only supported"),
    ({"options": {"reentrant": True}}, TypeError, r"options must be a RegionOptions or None, got dict"),
    ({"bogus": 1}, TypeError, r"unknown checkpointing option\(s\) bogus"),
    ({"storage": "host", "directory": "/nonexistent/acshim"}, ValueError, r"directory='/nonexistent/acshim' is not an "
     "existing directory"),
]


def _option_id(kwargs: dict) -> str:
    """A test id that is the same in every pytest-xdist worker (no object addresses)."""
    return ", ".join(f"{key}={getattr(value, '__name__', type(value).__name__) if callable(value) else value!r}"
                     for key, value in kwargs.items())


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh", "already_applied"])
@pytest.mark.parametrize(("kwargs", "error", "message"), BAD_OPTIONS, ids=[_option_id(k) for k, _, _ in BAD_OPTIONS])
def test_apply_checkpointing_rejects_bad_options_before_changing_the_model(kwargs, error, message, fresh) -> None:
    model = small_gpt()
    if not fresh:
        acshim.apply_checkpointing(model, acshim.EveryNth(2))
    before, regions = snapshot(model), acshim.checkpointed_modules(model)
    with pytest.raises(error, match=message):
        acshim.apply_checkpointing(model, **kwargs)
    assert snapshot(model) == before
    assert acshim.checkpointed_modules(model) == regions
    # the model still trains: the error did not surface later, at the first forward
    model(torch.randint(0, 32, (2, 8))).sum().backward()


@pytest.mark.parametrize(("kwargs", "error", "message"), BAD_OPTIONS[:9], ids=[_option_id(k) for k, _, _ in BAD_OPTIONS[:9]])
def test_region_options_and_build_options_validate_every_field(kwargs, error, message) -> None:
    with pytest.raises(error, match=message):
        acshim.RegionOptions(**kwargs)
    with pytest.raises(error, match=message):
        acshim.build_options(**kwargs)
    with pytest.raises(error, match=message):
        acshim.RegionOptions().replace(**kwargs)


def test_checkpoint_module_rejects_a_non_options_and_leaves_the_module_alone() -> None:
    block = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="checkpoint_module: options must be a RegionOptions, got dict"):
        acshim.checkpoint_module(block, {"reentrant": True})
    assert "forward" not in block.__dict__
    with pytest.raises(TypeError, match="checkpoint_module needs an nn.Module, got function"):
        acshim.checkpoint_module(lambda x: x, acshim.RegionOptions())


@pytest.mark.parametrize("function", ["remove_checkpointing", "checkpointed_modules", "apply_checkpointing",
                                      "uncheckpoint_module", "find_blocks"])
def test_model_functions_name_a_non_module_argument(function) -> None:
    with pytest.raises(TypeError, match=rf"{function} needs an nn.Module.*got str"):
        getattr(acshim, function)("abc")


def test_policies_take_a_bare_class_name_as_one_name_and_reject_bad_arguments() -> None:
    model = small_gpt()
    block_class = type(acshim.find_blocks(model)[0][1]).__name__
    assert acshim.Blocks(block_class).class_names == (block_class,)
    assert [n for n, _ in acshim.find_blocks(model, block_class)] == [n for n, _ in acshim.find_blocks(model)]
    with pytest.raises(TypeError, match="class_names must be class names as strings"):
        acshim.Blocks([1])
    with pytest.raises(TypeError, match="EveryNth of= must be a Policy"):
        acshim.EveryNth(2, of=3)
    with pytest.raises(ValueError, match="EveryNth start must be a whole number"):
        acshim.EveryNth(2, start=True)
    with pytest.raises(TypeError, match="SequentialStrategy pack_args_as_tuple must be True or False"):
        acshim.SequentialStrategy("each", pack_args_as_tuple="yes")
    with pytest.raises(TypeError, match="SequentialStrategy target must be a submodule name"):
        acshim.SequentialStrategy("each", target=0)


# --------------------------------------------------------------------------------------------------
# storage tier


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"native": "yes"}, TypeError, r"native must be True, False or None \(None: the C\+\+ extension"),
    ({"direct": "maybe"}, TypeError, r"direct must be True, False or None \(None: O_DIRECT"),
    ({"storage": "disk", "directory": "/nonexistent/acshim"}, ValueError, r"directory='/nonexistent/acshim' is not an "
     "existing directory; create it"),
    ({"storage": "host", "directory": "/nonexistent/acshim"}, ValueError, r"is not an existing directory"),
    ({"storage": "disk", "directory": 3}, TypeError, r"directory must be a path \(str or os.PathLike\) or None, got 3"),
    ({"backend": "cpu"}, TypeError, r"backend must be an acshim.backends.Backend or None"),
    ({"storage": "ssd"}, ValueError, r"storage must be one of \('host', 'disk'\)"),
])
@pytest.mark.parametrize("entry", ["offload", "boundary_offload"])
def test_offload_options_are_checked_at_the_call(entry, kwargs, error, message) -> None:
    with pytest.raises(error, match=message):
        getattr(storage, entry)(**kwargs)


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"directory": "/nonexistent/acshim"}, ValueError, r"directory='/nonexistent/acshim' is not an existing directory"),
    ({"directory": 3}, TypeError, r"directory must be a path"),
    ({"prefetch": -1}, ValueError, r"prefetch must be a non-negative int"),
    ({"bogus": 1}, TypeError, r"set_defaults: unknown option\(s\) bogus; known: storage, prefetch, min_bytes, directory"),
])
def test_set_defaults_rejects_bad_values_and_keeps_the_previous_defaults(kwargs, error, message, tmp_path) -> None:
    storage.set_defaults(directory=str(tmp_path))
    try:
        before = storage.get_defaults()
        with pytest.raises(error, match=message):
            storage.set_defaults(**kwargs)
        assert storage.get_defaults() is before
    finally:
        storage.reset_defaults()


# --------------------------------------------------------------------------------------------------
# JSON configs read by facades


@pytest.mark.parametrize(("text", "message"), [
    ('{"activation_checkpointing": {"partition_activations": true,}}', r"is not valid JSON: Expecting property name"),
    ("[1, 2]", r"must hold a JSON object .*got a list"),
])
def test_deepspeed_configure_with_a_malformed_json_file_raises_clearly_and_changes_nothing(tmp_path: Path, text,
                                                                                          message) -> None:
    from acshim.facades import deepspeed
    from acshim.facades.deepspeed.runtime.activation_checkpointing._state import STATE

    STATE.reset()
    try:
        deepspeed.checkpointing.configure(None, deepspeed_config={"activation_checkpointing": {"number_checkpoints": 3}})
        before = dict(vars(STATE))
        path = tmp_path / "ds_config.json"
        path.write_text(text)
        with pytest.raises(ValueError, match=message) as caught:
            deepspeed.checkpointing.configure(None, deepspeed_config=str(path), partition_activations=True)
        assert not isinstance(caught.value, json.JSONDecodeError)
        assert str(path) in str(caught.value)
        assert dict(vars(STATE)) == before
    finally:
        STATE.reset()


def test_sagemaker_v2_init_with_a_malformed_json_file_raises_clearly(tmp_path: Path, monkeypatch) -> None:
    import acshim.facades.torch.sagemaker as tsm

    monkeypatch.delenv("SM_HP_MP_PARAMETERS", raising=False)
    path = tmp_path / "smp_config.json"
    path.write_text('{"activation_loading_horizon": 2,')
    before = storage.get_defaults()
    with pytest.raises(ValueError, match=r"torch.sagemaker.init: cannot parse .* as JSON") as caught:
        tsm.init(str(path))
    assert not isinstance(caught.value, json.JSONDecodeError)
    assert storage.get_defaults() is before


def test_smp_launcher_parameters_with_malformed_json_raise_clearly(monkeypatch) -> None:
    import acshim.facades.smdistributed.modelparallel.torch as smp

    monkeypatch.setenv("SM_HP_MP_PARAMETERS", '{"microbatches": 2')
    smp.state.reset()
    try:
        with pytest.raises(ValueError, match="SM_HP_MP_PARAMETERS must hold a JSON object of SMP parameters"):
            smp.init({})
        assert not smp.state.initialized
    finally:
        smp.state.reset()


def test_documented_subpackages_are_reachable_after_a_bare_import() -> None:
    import subprocess
    import sys

    code = ("import acshim; acshim.selective.save_ops; acshim.storage.boundary_offload; acshim.testing.GPT\n"
            "try:\n    acshim.nothing\nexcept AttributeError as e:\n    print(e)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "module 'acshim' has no attribute 'nothing'"


# --------------------------------------------------------------------------------------------------
# facade entry points


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"partition_activations": "yes"}, ValueError, r"configure: partition_activations must be true or false, got 'yes'"),
    ({"num_checkpoints": "x"}, ValueError, r"configure: num_checkpoints must be a whole number of checkpointed layers"),
    ({"deepspeed_config": {"activation_checkpointing": {"cpu_checkpointing": "true"}}}, ValueError,
     r"deepspeed_config's activation_checkpointing.cpu_checkpointing must be true or false, got 'true'"),
])
def test_deepspeed_configure_rejects_bad_values_and_changes_nothing(kwargs, error, message) -> None:
    from acshim.facades import deepspeed
    from acshim.facades.deepspeed.runtime.activation_checkpointing._state import STATE

    STATE.reset()
    try:
        deepspeed.checkpointing.configure(None, partition_activations=False, num_checkpoints=2)
        before = dict(vars(STATE))
        with pytest.raises(error, match=message):
            deepspeed.checkpointing.configure(None, **kwargs)
        assert dict(vars(STATE)) == before
    finally:
        STATE.reset()


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"checkpoint_impl": "abc"}, ValueError, r"checkpoint_impl must be CheckpointImpl.NO_REENTRANT or "
     r"CheckpointImpl.REENTRANT, got 'abc'"),
    ({"preserve_rng_state": "x"}, TypeError, r"preserve_rng_state must be True or False, got 'x'"),
    ({"determinism_check": "bogus"}, ValueError, r"determinism_check should be one of \['default', 'none'\]"),
    ({"context_fn": "abc"}, TypeError, r"context_fn must be a function returning"),
    ({"checkpoint_fn": "abc"}, TypeError, r"checkpoint_fn must be a checkpoint function"),
])
def test_torch_checkpoint_wrapper_checks_its_options_when_wrapping(kwargs, error, message) -> None:
    from acshim.facades.torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    children = list(model)
    with pytest.raises(error, match=message):
        cw.checkpoint_wrapper(model[0], **kwargs)
    with pytest.raises(error, match=message):
        cw.apply_activation_checkpointing(
            model, checkpoint_wrapper_fn=lambda module: cw.checkpoint_wrapper(module, **kwargs),
            check_fn=lambda module: isinstance(module, torch.nn.Linear))
    assert list(model) == children  # nothing wrapped
    with pytest.raises(TypeError, match="apply_activation_checkpointing: check_fn must be callable, got 'abc'"):
        cw.apply_activation_checkpointing(model, check_fn="abc")
    assert list(model) == children


def test_measure_memory_checks_loss_fn_before_running_the_model() -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="measure_memory: loss_fn must be a function"):
        acshim.measure_memory(model, torch.randn(1, 2), loss_fn="sum")
    assert model.weight.grad is None
