"""DeepSpeed facade: configure and its JSON block, module globals, reset, profile/synchronize, offload routing."""

from __future__ import annotations

import base64
import copy
import json
import os
import re
import sys

import pytest
import torch
import torch.distributed as dist

from acshim.facades import deepspeed
from acshim.facades.deepspeed.runtime.activation_checkpointing import _profile
from acshim.facades.deepspeed.runtime.activation_checkpointing._state import GLOBAL_NAMES, STATE
from acshim.facades.deepspeed.runtime.activation_checkpointing.config import (
    DeepSpeedActivationCheckpointingConfig,
)

ckpt = deepspeed.checkpointing
FLAGS = ("PARTITION_ACTIVATIONS", "CONTIGUOUS_CHECKPOINTING", "num_layers", "CPU_CHECKPOINT", "SYNCHRONIZE",
         "PROFILE_TIME")


@pytest.fixture(autouse=True)
def fresh_state():
    STATE.reset()
    yield
    STATE.reset()


def flags() -> dict:
    return {name: getattr(ckpt, name) for name in FLAGS}


def block(**settings) -> dict:
    return {"train_batch_size": 8, "activation_checkpointing": settings}


class TensorParallelUnit:
    def __init__(self, rank=0, size=1, group="tp-group"):
        self.rank, self.size, self.group = rank, size, group

    def get_tensor_model_parallel_rank(self):
        return self.rank

    def get_tensor_model_parallel_world_size(self):
        return self.size

    def get_tensor_model_parallel_group(self):
        return self.group

    def get_data_parallel_rank(self):
        return 0


class LegacyModelParallelUnit:
    def get_model_parallel_rank(self):
        return 0

    def get_model_parallel_world_size(self):
        return 1

    def get_model_parallel_group(self):
        return "mp-group"


def test_configure_needs_no_torch_distributed_and_sets_is_configured_for_good():
    assert not dist.is_initialized()
    assert ckpt.is_configured() is False
    ckpt.configure(None)
    assert ckpt.is_configured() is True
    ckpt.reset()
    assert ckpt.is_configured() is True  # nothing sets it back, as upstream


def test_configure_defaults_every_flag_off():
    ckpt.PROFILE_TIME = True
    ckpt.num_layers = 9
    ckpt.configure(None)
    assert flags() == {name: (None if name == "num_layers" else False) for name in FLAGS}


def test_explicit_arguments_beat_json_which_beats_defaults():
    config = block(partition_activations=True, profile=True, number_checkpoints=7, cpu_checkpointing=True,
                   unknown_key="ignored")
    ckpt.configure(None, deepspeed_config=config, profile=False, num_checkpoints=3, synchronize=True)
    assert flags() == {"PARTITION_ACTIVATIONS": True, "CONTIGUOUS_CHECKPOINTING": False, "num_layers": 3,
                       "CPU_CHECKPOINT": True, "SYNCHRONIZE": True, "PROFILE_TIME": False}


def test_json_config_from_a_file_path_and_from_base64(tmp_path):
    settings = block(partition_activations=True, contiguous_memory_optimization=True, number_checkpoints=4)
    path = tmp_path / "ds_config.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump(settings, handle)
    ckpt.configure(None, deepspeed_config=str(path))
    from_file = flags()
    assert from_file["CONTIGUOUS_CHECKPOINTING"] is True and from_file["num_layers"] == 4
    ckpt.configure(None, deepspeed_config=base64.urlsafe_b64encode(json.dumps(settings).encode()).decode())
    assert flags() == from_file


def test_bad_json_configs_raise_upstream_errors(tmp_path):
    with pytest.raises(ValueError, match="Expected a string path to an existing deepspeed config"):
        ckpt.configure(None, deepspeed_config="no/such/file.json")
    path = tmp_path / "dup.json"
    path.write_text('{"train_batch_size": 1, "train_batch_size": 2}')
    with pytest.raises(ValueError, match="Duplicate keys in DeepSpeed config"):
        ckpt.configure(None, deepspeed_config=str(path))


def test_missing_block_gives_defaults():
    config = DeepSpeedActivationCheckpointingConfig({"train_batch_size": 1})
    assert config.repr() == {"partition_activations": False, "contiguous_memory_optimization": False,
                             "cpu_checkpointing": False, "number_checkpoints": None, "profile": False,
                             "synchronize_checkpoint_boundary": False}


def test_contiguous_checkpointing_asserts_and_leaves_state_unchanged():
    with pytest.raises(AssertionError, match="Contiguous Checkpointing is only available with partitioned"):
        ckpt.configure(None, contiguous_checkpointing=True, num_checkpoints=2)
    with pytest.raises(AssertionError, match="Must specify the number of layers with contiguous memory"):
        ckpt.configure(None, partition_activations=True, contiguous_checkpointing=True)
    assert ckpt.is_configured() is False and ckpt.PARTITION_ACTIVATIONS is False


def test_mpu_sets_model_parallel_globals_and_none_keeps_it():
    unit = TensorParallelUnit(rank=0, size=1)
    ckpt.configure(unit)
    assert (ckpt.mpu, ckpt.mp_rank, ckpt.mp_size, ckpt.mp_group) == (unit, 0, 1, "tp-group")
    ckpt.configure(None, partition_activations=True)
    assert ckpt.mpu is unit
    legacy = LegacyModelParallelUnit()
    ckpt.configure(legacy)
    assert (ckpt.mpu, ckpt.mp_group) == (legacy, "mp-group")


def test_module_globals_are_live_reads_and_writes_of_one_state():
    snapshot = {name: getattr(ckpt, name) for name in GLOBAL_NAMES}  # as DeepSpeed's tests do
    ckpt.PARTITION_ACTIVATIONS = True
    ckpt.mp_size = 2
    assert STATE.PARTITION_ACTIVATIONS is True and "PARTITION_ACTIVATIONS" in dir(ckpt)
    from acshim.facades.deepspeed.checkpointing import mp_size

    assert mp_size == 2
    with pytest.raises(AssertionError, match="not divisible by mp size"):  # checkpoint reads the assigned globals
        ckpt.checkpoint(torch.sin, torch.randn(3, requires_grad=True))
    for name, value in snapshot.items():
        setattr(ckpt, name, value)
    assert ckpt.PARTITION_ACTIVATIONS is False and ckpt.mp_size == 1
    STATE.num_layers = 5
    assert ckpt.num_layers == 5


def test_reset_clears_contiguous_bookkeeping_only_when_contiguous_is_on():
    ckpt.contiguous_data_buffers = [[torch.zeros(1)]]
    ckpt.data_offsets = [1]
    ckpt.reset()
    assert ckpt.data_offsets == [1]
    ckpt.configure(None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=2, profile=True)
    ckpt.reset()
    assert ckpt.contiguous_data_buffers == [] and ckpt.data_offsets == [] and ckpt.PROFILE_TIME is True


def test_set_num_layers_and_partition_switch_set_only_their_global():
    ckpt.set_num_layers(12)
    ckpt.partition_activations_in_checkpoint(True)
    assert flags() == {"PARTITION_ACTIVATIONS": True, "CONTIGUOUS_CHECKPOINTING": False, "num_layers": 12,
                       "CPU_CHECKPOINT": False, "SYNCHRONIZE": False, "PROFILE_TIME": False}
    assert ckpt.is_configured() is False


@pytest.mark.parametrize("checkpoint", [ckpt.checkpoint, ckpt.non_reentrant_checkpoint])
def test_profile_prints_forward_and_backward_times_in_upstream_format(checkpoint, capsys):
    ckpt.configure(None, profile=True)
    x = torch.randn(8, requires_grad=True)
    out = checkpoint(lambda t: t.sin().exp(), x)
    forward_log = capsys.readouterr().out
    out.sum().backward()
    backward_log = capsys.readouterr().out
    assert re.fullmatch(r"\[Rank -1\] time \(ms\) \| fwd: \d+\.\d\d\n", forward_log)
    assert re.fullmatch(r"\[Rank -1\] time \(ms\) \| backward: \d+\.\d\d\n", backward_log)
    assert isinstance(ckpt.timers, _profile.Timers)


def test_reentrant_profile_backward_time_includes_the_inner_backward(monkeypatch):
    layer = torch.nn.Linear(4, 4)
    events = []
    original_end = _profile.CheckpointObserver._end

    class MarkInnerBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            events.append("inner backward")
            return grad

    def spy(self, name):
        if name == "backward":
            events.append("timer stopped")
        original_end(self, name)

    monkeypatch.setattr(_profile.CheckpointObserver, "_end", spy)
    ckpt.configure(None, profile=True)
    ckpt.checkpoint(lambda x: layer(MarkInnerBackward.apply(x)), torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert events == ["inner backward", "timer stopped"]  # the timer spans the region's inner backward


def test_synchronize_waits_for_the_device_at_each_boundary(monkeypatch):
    calls = []
    monkeypatch.setattr(_profile, "synchronize_device", lambda: calls.append(1))
    ckpt.configure(None, synchronize=True)
    x = torch.randn(4, requires_grad=True)
    out = ckpt.checkpoint(torch.sin, x)
    assert len(calls) == 2  # start and end of the forward
    out.sum().backward()
    assert len(calls) == 4  # start and end of the backward
    assert torch.equal(x.grad, x.detach().cos())


@pytest.mark.parametrize("checkpoint", [ckpt.checkpoint, ckpt.non_reentrant_checkpoint])
def test_cpu_checkpointing_routes_checkpoint_inputs_to_the_host_offload_tier(checkpoint):
    storage = pytest.importorskip("acshim.storage")
    x = torch.randn(64, 64, requires_grad=True)
    with storage.recording() as sessions:
        checkpoint(torch.sin, x).sum().backward()
    assert sessions == []  # off unless configured
    x.grad = None
    ckpt.configure(None, checkpoint_in_cpu=True)
    with storage.recording() as sessions:
        checkpoint(torch.sin, x).sum().backward()
        checkpoint(torch.sin, x).sum().backward()
    assert len(sessions) == 1  # one shared session, like upstream's shared offload engine
    stats = sessions[0].stats
    assert (stats.storage, stats.prefetch) == ("host", 1) and stats.saved >= 2
    assert torch.equal(x.grad, 2 * x.detach().cos())
    ckpt.reset()
    assert ckpt._cpu_offload_engine is None


def test_cpu_checkpointing_without_a_storage_tier_keeps_data_in_place(monkeypatch):
    monkeypatch.setitem(sys.modules, "acshim.storage", None)  # import fails: no offload, still exact
    ckpt.configure(None, checkpoint_in_cpu=True)
    x = torch.randn(4, requires_grad=True)
    ckpt.checkpoint(torch.sin, x).sum().backward()
    assert torch.equal(x.grad, x.detach().cos())


# DeepSpeed's later TestCPUActivationCheckpoint checks (GPU-only upstream), on CPU, bitwise


@pytest.mark.parametrize("checkpoint", [ckpt.checkpoint, ckpt.non_reentrant_checkpoint])
def test_cpu_checkpointing_stacked_layers_match_a_plain_run(checkpoint):
    torch.manual_seed(1234)
    layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(4))
    reference_layers = copy.deepcopy(layers)
    x = torch.randn(8, 64)
    x_reference, x_test = x.clone().requires_grad_(), x.clone().requires_grad_()
    hidden = x_reference
    for layer in reference_layers:
        hidden = layer(hidden)
    hidden.sum().backward()
    ckpt.configure(None, checkpoint_in_cpu=True)
    hidden = x_test
    for layer in layers:
        hidden = checkpoint(layer, hidden)
    hidden.sum().backward()
    assert torch.equal(x_reference.grad, x_test.grad)
    for reference, tested in zip(reference_layers.parameters(), layers.parameters()):
        assert torch.equal(reference.grad, tested.grad)


def test_cpu_checkpointing_passes_bool_masks_through_and_no_grad_starts_no_offload():
    storage = pytest.importorskip("acshim.storage")
    ckpt.configure(None, checkpoint_in_cpu=True)
    layer = torch.nn.Linear(8, 8)
    x = torch.randn(8, requires_grad=True)
    mask = torch.randn(8) > 0
    out = ckpt.checkpoint(lambda t, m: layer(t) * m.type_as(t), x, mask)
    out.sum().backward()
    assert torch.equal(x.grad, layer.weight.t().mv(mask.float()))
    with storage.recording() as sessions, torch.no_grad():
        ckpt.reset()
        ckpt.checkpoint(layer, x)
    assert sessions == [] and ckpt._cpu_offload_engine is None
