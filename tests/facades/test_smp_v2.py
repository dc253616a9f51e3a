"""SMP v2 (``torch.sagemaker``) through the facade: init/config, state, routing, a v2 training step."""

from __future__ import annotations

import functools
import json
import os

import pytest
import torch
from torch import nn

import acshim.facades.torch.sagemaker as tsm
from acshim.facades.torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
    offload_wrapper,
)
from acshim.facades.torch.sagemaker import _offload as tsm_offload
from acshim.facades.torch.sagemaker import grad_norm
from acshim.rng import get_rng_tracker
from acshim.testing import MLPBlock, hf_inputs, hf_model, seeded, tiny_sequential


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch):
    from acshim import storage

    monkeypatch.delenv("SM_HP_MP_PARAMETERS", raising=False)
    tsm._state.state.reset()
    previous = storage.get_defaults()
    yield
    storage.set_defaults(**vars(previous))  # tsm.init writes process-wide engine defaults
    tsm._state.state.reset()


def test_init_without_config_uses_documented_defaults():
    assert not tsm.is_initialized()
    tsm.init()
    assert tsm.is_initialized()
    s = tsm.state
    assert (s.hybrid_shard_degree, s.sm_activation_offloading, s.activation_loading_horizon) == (0, True, 2)
    assert (s.fsdp_cache_flush_warnings, s.allow_empty_shards, s.random_seed) == (True, False, None)
    assert (s.tensor_parallel_degree, s.tp_size, s.tp_rank, s.expert_parallel_degree) == (1, 1, 0, 1)
    assert (s.rank, s.world_size) == (0, 1)
    # native fallback: SMP creates no process groups
    assert s.tp_process_group is None and s.rep_rank_process_group is None and s.world_process_group is None
    assert s.get_rng_state_tracker() is get_rng_tracker()


def test_init_reads_a_dict_or_a_json_file(tmp_path):
    tsm.init({"activation_loading_horizon": 3, "sm_activation_offloading": False})
    assert (tsm.state.activation_loading_horizon, tsm.state.sm_activation_offloading) == (3, False)
    path = tmp_path / "smp_config.json"
    path.write_text(json.dumps({"hybrid_shard_degree": 1, "random_seed": 7}))
    os.chmod(path, 0o600)
    tsm.init(str(path))
    assert (tsm.state.hybrid_shard_degree, tsm.state.random_seed, tsm.state.activation_loading_horizon) == (1, 7, 2)
    tsm.init(path)  # a PathLike works too
    with pytest.raises(ValueError, match="does not exist"):
        tsm.init(str(tmp_path / "missing.json"))
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        tsm.init(str(path))
    with pytest.raises(TypeError, match="takes a dict, a JSON file path or None"):
        tsm.init(42)


def test_environment_overrides_the_init_argument_which_overrides_defaults(monkeypatch):
    monkeypatch.setenv("SM_HP_MP_PARAMETERS", json.dumps({"activation_loading_horizon": 5}))
    tsm.init({"activation_loading_horizon": 3, "sm_activation_offloading": False})
    assert tsm.state.activation_loading_horizon == 5
    assert tsm.state.sm_activation_offloading is False
    assert tsm.state.hybrid_shard_degree == 0


@pytest.mark.parametrize(("config", "message"), [
    ({"activation_loading_horizon": 0}, "activation_loading_horizon must be a positive int, got 0"),
    ({"activation_loading_horizon": -2}, "activation_loading_horizon must be a positive int"),
    ({"activation_loading_horizon": "2"}, "activation_loading_horizon must be a positive int, got '2'"),
    ({"activation_loading_horizon": True}, "activation_loading_horizon must be a positive int, got True"),
    ({"sm_activation_offloading": "yes"}, "sm_activation_offloading must be True or False"),
    ({"tensor_parallel_degree": 2}, r"tensor_parallel_degree must be an int between 1 and the world size \(1\)"),
    ({"expert_parallel_degree": 0}, "expert_parallel_degree must be an int between 1 and the world size"),
    ({"hybrid_shard_degree": -1}, "hybrid_shard_degree must be an int between 0 and the world size"),
    ({"random_seed": 1.5}, "random_seed must be an int"),
])
def test_bad_values_raise_value_errors_naming_the_key(config, message):
    with pytest.raises(ValueError, match=message):
        tsm.init(config)
    assert not tsm.is_initialized()


def test_unknown_keys_warn_and_are_ignored():
    with pytest.warns(UserWarning, match="unknown config key 'microbatches' ignored"):
        tsm.init({"microbatches": 4})
    assert not hasattr(tsm.state, "microbatches")


def test_offloading_flags_map_to_the_engine_prefetch_horizon():
    assert tsm_offload.engine_defaults(True, 3) == {"prefetch": 3}
    assert tsm_offload.engine_defaults(False, 3) == {"prefetch": 0}  # native offloading: no prefetch
    from acshim import storage

    tsm.init({"activation_loading_horizon": 3})
    assert tsm.state.offload_status == "live" and storage.get_defaults().prefetch == 3
    tsm.init({"activation_loading_horizon": 3, "sm_activation_offloading": False})
    assert storage.get_defaults().prefetch == 0


def test_transform_with_degree_1_returns_the_same_model():
    model = nn.Linear(2, 2)
    assert tsm.transform(model) is model
    assert tsm.transform(model, dtype=torch.float64) is model and model.weight.dtype == torch.float64
    with pytest.raises(NotImplementedError, match="expert-parallel MoE implementation"):
        tsm.transform(model, config=object())
    with pytest.raises(ValueError, match="cp_comm_type must be 'p2p' or 'all_gather'"):
        tsm.transform(model, cp_comm_type="ring")


def test_clip_grad_norm_is_torchs_in_the_native_fallback():
    first, second = seeded(lambda: nn.Linear(4, 4)), seeded(lambda: nn.Linear(4, 4))
    for model in (first, second):
        model(torch.ones(2, 4)).square().sum().backward()
    expected = torch.nn.utils.clip_grad_norm_(first.parameters(), 0.1)
    assert torch.equal(grad_norm.clip_grad_norm_(second, 0.1), expected)
    assert torch.equal(first.weight.grad, second.weight.grad)


@pytest.mark.parametrize(("module", "name", "args"), [
    ("delayed_param", "DelayedParamIniter", (nn.Linear(1, 1),)),
    ("moe.moe_config", "MoEConfig", ()),
    ("nn.attn", "FlashSelfAttention", ()),
    ("nn.attn", "FlashGroupedQueryAttention", ()),
    ("utils.module_utils", "empty_module_params", (nn.Linear(1, 1),)),
    ("utils.module_utils", "move_buffers_to_device", (nn.Linear(1, 1), "cpu")),
    ("distributed.checkpoint.state_dict_saver", "save", ({}, "ckpt")),
    ("distributed.checkpoint.state_dict_saver", "async_save", ({}, "ckpt")),
    ("distributed.checkpoint.state_dict_saver", "maybe_finalize_async_calls", ()),
    ("distributed.checkpoint.state_dict_loader", "load", ({}, "ckpt")),
])
def test_names_needing_smps_own_implementation_raise_not_implemented(module, name, args):
    import importlib

    target = getattr(importlib.import_module(f"acshim.facades.torch.sagemaker.{module}"), name)
    with pytest.raises(NotImplementedError, match=f"torch.sagemaker.{module}.{name}: .* is not provided by acshim; "):
        target(*args)


def _v2_step(checkpoint: bool, offload: bool):
    tsm.init({"sm_activation_offloading": True, "activation_loading_horizon": 2})
    model = seeded(lambda: tiny_sequential(3, width=32))
    if checkpoint:
        apply_activation_checkpointing(
            model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.REENTRANT),
            check_fn=lambda m: isinstance(m, MLPBlock))
    if offload and tsm.state.sm_activation_offloading:
        model = offload_wrapper(model)
    torch.manual_seed(1)
    model(torch.randn(4, 32)).square().mean().backward()
    grad_norm.clip_grad_norm_(model, 1.0)
    return [p.grad for p in model.parameters()]


@pytest.mark.filterwarnings("ignore:Please specify CheckpointImpl.NO_REENTRANT")
def test_v2_checkpointing_and_offload_wrapper_match_the_plain_step():
    expected = _v2_step(False, False)
    for checkpoint, offload in ((True, False), (True, True)):
        actual = _v2_step(checkpoint, offload)
        assert all(torch.equal(e, a) for e, a in zip(expected, actual, strict=True))


def test_v2_hf_gpt2_with_apply_activation_checkpointing_matches_plain_step():
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    tsm.init()
    inputs = dict(hf_inputs("gpt2"), use_cache=False)

    def grads(checkpoint):
        model = hf_model("gpt2")
        if checkpoint:
            apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, GPT2Block))
            model = offload_wrapper(model)
        torch.manual_seed(1)
        model(**inputs)["loss"].backward()
        return [p.grad for p in model.parameters()]

    assert all(torch.equal(e, a) for e, a in zip(grads(False), grads(True), strict=True))
