"""SMP v1 around checkpointing: init/config, DistributedModel, DistributedOptimizer, smp.step, ranks."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import acshim.facades.smdistributed.modelparallel.torch as smp
from acshim.facades.smdistributed.modelparallel.torch import offload
from acshim.facades.smdistributed.modelparallel.torch.exceptions import (
    BwdExecutionNotInStepFnError,
    ModelNotPartitionedError,
    MultipleDistributedModelError,
    NotInitializedError,
    SMPInvalidArgumentError,
    SMPUnsupportedError,
    TensorSplitError,
)
from acshim.testing import seeded, tiny_sequential

pytestmark = pytest.mark.usefixtures("fresh_smp")


# ---- init and config -----------------------------------------------------------------------------


def test_init_without_config_uses_library_defaults():
    assert not smp.is_initialized()
    smp.init()
    assert smp.is_initialized()
    cfg = smp.state.cfg
    assert (cfg.partitions, cfg.microbatches, cfg.pipeline, cfg.offload_activations) == (1, 1, "interleaved", False)
    assert cfg.activation_loading_horizon == 4 and cfg.active_microbatches == 1
    assert smp.num_microbatches() == 1


def test_environment_overrides_init_dict_which_overrides_defaults(monkeypatch):
    monkeypatch.setenv("SM_HP_MP_PARAMETERS", json.dumps({"microbatches": 4, "optimize": "memory"}))
    smp.init({"partitions": 1, "microbatches": 2, "offload_activations": True})
    cfg = smp.state.cfg
    assert cfg.microbatches == 4  # launcher value wins over the script's dict
    assert cfg.optimize == "memory"  # launcher-only key
    assert cfg.offload_activations is True  # script-only key
    assert cfg.memory_weight == 0.8  # default


def test_partitions_is_an_alias_and_conflicts_are_rejected():
    smp.init({"pipeline_parallel_degree": 1})
    assert smp.state.cfg.partitions == 1
    with pytest.raises(SMPInvalidArgumentError, match="Conflicting values 1 and 2"):
        smp.init({"partitions": 2, "pipeline_parallel_degree": 1})


@pytest.mark.parametrize(("config", "message"), [
    ({"microbatchez": 2}, "Unrecognized config parameter microbatchez."),
    ({"microbatches": 0}, r"microbatches \(0\) cannot be less than 1"),
    ({"microbatches": 2.0}, "microbatches type needs to be one of \\['int'\\]. Found: float"),
    ({"pipeline": "gpipe"}, "pipeline must be one of"),
    ({"placement_strategy": "random"}, "placement_strategy must be one of"),
    ({"ddp": "yes"}, "ddp type needs to be one of \\['bool'\\]"),
    ({"offload_activations": 1}, "offload_activations type needs to be one of \\['bool'\\]"),
    ({"activation_loading_horizon": -1}, r"activation_loading_horizon \(-1\) cannot be less than 0"),
    ({"ddp": True, "horovod": True}, "'ddp' and 'horovod' cannot be simultaneously enabled."),
    ({"auto_partition": False}, "default_partition must be supplied if auto_partition is set to False!"),
    ({"auto_partition": False, "default_partition": 1}, "default_partition must be less than the number of partitions!"),
    ({"memory_weight": 1.5}, r"memory_weight \(1.5\) cannot be larger than 1.0"),
    ({"microbatches": 2, "active_microbatches": 3}, "active_microbatches .* cannot be larger than microbatches"),
    ({"tensor_parallel_degree": 2}, "requires ddp to be set to True"),
])
def test_bad_config_values_raise_upstream_errors(config, message):
    with pytest.raises(ValueError, match=message):
        smp.init(config)
    assert not smp.is_initialized()


def test_bad_environment_json_is_reported(monkeypatch):
    monkeypatch.setenv("SM_HP_MP_PARAMETERS", "{not json")
    with pytest.raises(SMPInvalidArgumentError, match="SM_HP_MP_PARAMETERS must hold a JSON object"):
        smp.init()


def test_unmodelled_keys_are_accepted_and_kept():
    smp.init({"ddp": True, "fp16": False, "placement_strategy": "spread", "prescaled_batch": False,
              "shard_optimizer_state": False, "skip_tracing": True})
    assert smp.state.cfg.placement_strategy == "spread" and smp.state.cfg.skip_tracing is True


def test_more_than_one_partition_warns_and_runs_in_this_process():
    with pytest.warns(UserWarning, match="pipeline_parallel_degree=2: acshim runs this script in one process"):
        smp.init({"partitions": 2})
    assert smp.pp_size() == 1 and smp.pp_rank() == 0


def test_offload_is_only_active_with_more_than_one_microbatch():
    smp.init({"offload_activations": True})
    assert offload.offload_status(smp.state.cfg).startswith("inactive: offload_activations needs microbatches > 1")
    assert smp.state.offload_scope() is None
    smp.init({"microbatches": 2})
    assert offload.offload_status(smp.state.cfg) == "off" and smp.state.offload_scope() is None
    smp.init({"offload_activations": True, "microbatches": 2, "activation_loading_horizon": 3})
    assert offload.offload_status(smp.state.cfg) == "live"
    scope = smp.state.offload_scope()
    assert scope is smp.state.offload_scope()  # one schedule shared by every region
    assert (scope.options.storage, scope.options.prefetch) == ("host", 3)


def _offload_run(offload_activations):
    smp.state.reset()
    smp.init({"microbatches": 2, "offload_activations": offload_activations})
    model = smp.DistributedModel(seeded(lambda: tiny_sequential(3, width=16)))
    smp.set_activation_checkpointing(model.get_module(), strategy="each")

    @smp.step
    def train(model, data):
        model.backward(model(data).square().mean())

    torch.manual_seed(1)
    train(model, torch.randn(4, 16))
    return [p.grad for p in model.parameters()], smp.state.offload_scope()


def test_offload_activations_routes_region_inputs_to_the_engine_storage_tier():
    expected, no_scope = _offload_run(False)
    actual, scope = _offload_run(True)
    assert no_scope is None
    assert all(torch.equal(e, a) for e, a in zip(expected, actual, strict=True))
    assert scope.stats.saved >= 6  # 3 regions x 2 microbatches handed their boundary inputs to the tier


# ---- DistributedModel / DistributedOptimizer -----------------------------------------------------


def test_distributed_model_needs_init_and_is_one_per_script():
    with pytest.raises(NotInitializedError, match="smp is not initialized!"):
        smp.DistributedModel(nn.Linear(2, 2))
    smp.init()
    smp.DistributedModel(nn.Linear(2, 2))
    with pytest.raises(MultipleDistributedModelError, match="more than once"):
        smp.DistributedModel(nn.Linear(2, 2))
    smp.reset()
    smp.DistributedModel(nn.Linear(2, 2))


def test_distributed_model_is_transparent_with_the_user_modules_state_dict():
    smp.init()
    inner = seeded(lambda: tiny_sequential(2, width=8))
    model = smp.DistributedModel(inner)
    assert model.get_module() is inner and model.module is inner
    x = torch.randn(3, 8)
    torch.manual_seed(0)
    out = model(x)
    torch.manual_seed(0)
    assert torch.equal(out, inner(x))
    assert list(model.state_dict()) == list(inner.state_dict())
    other = seeded(lambda: tiny_sequential(2, width=8), seed=5)
    model.load_state_dict(other.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(inner.state_dict().values(), other.state_dict().values()))


def test_backward_only_inside_step_and_local_helpers_after_partitioning():
    smp.init()
    model = smp.DistributedModel(nn.Linear(4, 2))
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(BwdExecutionNotInStepFnError, match="inside smp.step annotated function"):
        model.backward(model(torch.randn(1, 4)).sum())
    with pytest.raises(ModelNotPartitionedError, match="has not been partitioned yet"):
        list(model.local_parameters())
    calls = []
    handle = model.register_post_partition_hook(lambda m, o: calls.append((m, o)))
    assert handle is not None and not model.partitioned

    @smp.step
    def train(model, x):
        loss = model(x).sum()
        model.backward(loss)
        return loss

    train(model, torch.randn(2, 4))
    assert model.partitioned and calls == [(model, optimizer)]
    assert [n for n, _ in model.local_named_parameters()] == ["weight", "bias"]
    assert len(list(model.local_modules())) == 1 and list(model.local_buffers()) == []
    assert list(model.local_state_dict()) == ["weight", "bias"]
    train(model, torch.randn(2, 4))
    assert len(calls) == 1  # called once, at partitioning
    late = []
    assert model.register_post_partition_hook(lambda m, o: late.append(o)) is None and late == [optimizer]


def test_distributed_optimizer_steps_the_wrapped_optimizer_and_works_with_schedulers():
    smp.init()
    model = smp.DistributedModel(nn.Linear(4, 1))
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.1)
    before = model.module.weight.detach().clone()
    model.module.weight.grad = torch.ones_like(before)
    optimizer.step()
    scheduler.step()
    assert torch.equal(model.module.weight.detach(), before - 0.5)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    assert optimizer.state_dict() == optimizer.optimizer.state_dict() == optimizer.local_state_dict()
    optimizer.zero_grad()
    assert model.module.weight.grad is None


# ---- smp.step ------------------------------------------------------------------------------------


def _run_steps(microbatches, checkpoint, batch):
    smp.state.reset()
    smp.init({"microbatches": microbatches})
    model = smp.DistributedModel(seeded(lambda: tiny_sequential(3, width=16)))
    if checkpoint:
        smp.set_activation_checkpointing(model.get_module(), strategy=checkpoint)

    @smp.step()
    def train(model, data, target):
        output = model(data)
        loss = F.mse_loss(output, target)
        model.backward(loss)
        return loss, output

    torch.manual_seed(1)
    loss, output = train(model, *batch)
    return {n: p.grad.clone() for n, p in model.named_parameters()}, loss, output


@pytest.mark.parametrize("strategy", ["each", "group_2"])
def test_microbatched_step_with_checkpointing_matches_same_step_without(strategy):
    batch = (torch.randn(8, 16), torch.randn(8, 16))
    plain, plain_loss, _ = _run_steps(4, None, batch)
    checkpointed, loss, _ = _run_steps(4, strategy, batch)
    assert all(torch.equal(plain[k], checkpointed[k]) for k in plain)
    assert all(torch.equal(a, b) for a, b in zip(plain_loss.outputs, loss.outputs))


def test_microbatch_gradients_are_averaged_to_the_full_batch_gradient():
    batch = (torch.randn(8, 16), torch.randn(8, 16))
    model = seeded(lambda: tiny_sequential(3, width=16)).eval()  # no dropout: same function per row
    F.mse_loss(model(batch[0]), batch[1]).backward()
    full = {f"module.{n}": p.grad for n, p in model.named_parameters()}
    smp.init({"microbatches": 4})
    wrapped = smp.DistributedModel(seeded(lambda: tiny_sequential(3, width=16)).eval())

    @smp.step
    def train(model, data, target):
        loss = F.mse_loss(model(data), target)
        model.backward(loss)
        return loss

    loss = train(wrapped, *batch)
    assert len(loss.outputs) == 4
    for name, param in wrapped.named_parameters():
        torch.testing.assert_close(param.grad, full[name], rtol=1e-5, atol=1e-6)


def test_step_outputs_split_per_microbatch_and_reduce():
    smp.init({"microbatches": 2})
    model = smp.DistributedModel(nn.Identity())
    seen = []

    @smp.step(non_split_inputs=["weights"], input_split_axes={"columns": 1})
    def evaluate(model, rows, columns, weights, extra):
        seen.append((rows.shape, columns.shape, weights.shape, extra["t"].shape, extra["name"]))
        return rows.sum(), {"rows": rows, "n": 1}

    total, parts = evaluate(model, torch.arange(4.0), torch.ones(3, 4), torch.ones(5), {"t": torch.ones(6), "name": "x"})
    assert seen == [((2,), (3, 2), (5,), (3,), "x")] * 2
    assert isinstance(total, smp.StepOutput) and total.outputs == [torch.tensor(1.0), torch.tensor(5.0)]
    assert total.reduce_mean() == 3.0 and total.reduce_sum() == 6.0
    assert torch.equal(parts["rows"].concat(), torch.arange(4.0))
    assert torch.equal(parts["rows"].stack(), torch.arange(4.0).view(2, 2))
    assert parts["n"] == [1, 1]
    assert total.map(lambda t: t * 2).outputs == [torch.tensor(2.0), torch.tensor(10.0)]


def test_step_detaches_outputs_unless_asked_not_to():
    smp.init()
    model = smp.DistributedModel(nn.Linear(2, 1))

    @smp.step(detach_outputs=False)
    def forward_kept(model, x):
        return model(x)

    @smp.step
    def forward_detached(model, x):
        return model(x)

    x = torch.randn(2, 2)
    assert forward_kept(model, x).outputs[0].requires_grad
    assert not forward_detached(model, x).outputs[0].requires_grad


def test_step_reports_indivisible_batches_and_bad_arguments():
    smp.init({"microbatches": 3})
    model = smp.DistributedModel(nn.Identity())

    @smp.step
    def run(model, x):
        return x

    with pytest.raises(ValueError, match="Batch size must be divisible by the number of microbatches. Found batch "
                                         "size=4, number of microbatches=3"):
        run(model, torch.ones(4))
    with pytest.raises(TensorSplitError, match="contains a non-argument"):
        smp.step(non_split_inputs=["y"])(lambda model, x: x)
    with pytest.raises(TensorSplitError, match="Non-split inputs must be a list."):
        smp.step(non_split_inputs="x")(lambda model, x: x)


def test_step_adds_earlier_gradients_back_unscaled():
    smp.init({"microbatches": 2})
    model = smp.DistributedModel(nn.Linear(2, 1, bias=False))
    model.module.weight.grad = torch.full((1, 2), 10.0)

    @smp.step
    def train(model, x):
        model.backward(model(x).sum())

    x = torch.ones(4, 2)
    train(model, x)
    assert torch.equal(model.module.weight.grad, torch.full((1, 2), 12.0))  # 10 + (2 + 2) / 2


# ---- ranks, groups, collectives, misc -------------------------------------------------------------


def test_rank_helpers_describe_one_process():
    smp.init()
    ranks = [smp.rank, smp.local_rank, smp.dp_rank, smp.mp_rank, smp.pp_rank, smp.tp_rank, smp.rdp_rank]
    sizes = [smp.size, smp.local_size, smp.dp_size, smp.mp_size, smp.pp_size, smp.tp_size, smp.rdp_size]
    assert [f() for f in ranks] == [0] * 7 and [f() for f in sizes] == [1] * 7
    assert smp.get_mp_group() == smp.get_dp_group() == smp.get_tp_group() == [0]
    assert smp.get_world_process_group() is None and smp.get_tp_process_group() is None
    assert smp.WORLD is smp.CommGroup.WORLD and smp.DP_GROUP.get_rank_type() is smp.RankType.DP_RANK
    assert smp.barrier() is None and smp.dp_barrier() is None and smp.barrier(smp.MP_GROUP) is None
    assert smp.broadcast({"a": 1}, smp.WORLD) is None
    assert smp.allgather(3, smp.DP_GROUP) == [3] and smp.gather(3, smp.DP_GROUP) == [3]
    with pytest.raises(SMPUnsupportedError, match="no other rank to send to"):
        smp.send(1, 1, smp.RankType.PP_RANK)
    with pytest.raises(SMPUnsupportedError, match="no other rank to receive from"):
        smp.recv_from(1, smp.RankType.PP_RANK)


def test_placement_controls_validate_and_change_nothing():
    smp.init()
    with smp.partition(0):
        layer = nn.Linear(2, 2)
    smp.set_partition(layer, 0)
    with pytest.raises(SMPInvalidArgumentError, match=r"partition index must be an int in \[0, 1\)"):
        smp.set_partition(layer, 1)
    with smp.model_creation(tensor_parallelism=True, dtype=torch.float64), smp.tensor_parallelism(), \
            smp.delay_param_initialization():
        double = nn.Linear(2, 2)
    assert double.weight.dtype == torch.float64 and torch.get_default_dtype() == torch.float32
    smp.set_tensor_parallelism(layer)
    assert smp.is_tracing() is False


def test_save_and_load_round_trip_and_sharded_checkpoints_are_not_provided(tmp_path):
    path = tmp_path / "model.pt"
    smp.save({"w": torch.ones(2)}, path)
    assert torch.equal(smp.load(path)["w"], torch.ones(2))
    with pytest.raises(NotImplementedError, match="SMP's sharded checkpoint layout"):
        smp.save_checkpoint(str(tmp_path), "tag")
    with pytest.raises(NotImplementedError, match="SMP's sharded checkpoint layout"):
        smp.resume_from_checkpoint(str(tmp_path))


def test_amp_and_nn_names():
    x = torch.randn(3, 8)
    torch.testing.assert_close(smp.nn.FusedLayerNorm(8)(x), nn.LayerNorm(8)(x), rtol=0, atol=0)
    with pytest.raises(NotImplementedError, match="tensor-parallel module of SMP v1"):
        smp.nn.DistributedTransformerLMHead  # noqa: B018
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scaler = smp.amp.GradScaler(enabled=False)
    assert scaler.scale(torch.tensor(2.0)) == 2.0


def test_join_needs_ddp():
    smp.init()
    model = smp.DistributedModel(nn.Linear(2, 2))
    with pytest.raises(SMPUnsupportedError, match="join is only supported when using DDP"):
        with model.join():
            pass
