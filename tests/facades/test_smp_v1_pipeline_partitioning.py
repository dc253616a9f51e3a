"""SMP v1 pipeline partitioning in one process: the automatic partitioner's balance and its rule that
an ``nn.Sequential`` child lies whole on one partition, the trace that leaves training unchanged,
manual placement with ``smp.partition``, and the seed's checkpointing rules at partition boundaries
(groups never cross one; a split checkpointed module is an error when placed by hand and a warning
under automatic partitioning). The runs across ranks are in tests/distributed/test_smp_v1_pipeline.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import acshim.facades.smdistributed.modelparallel.torch as smp
from acshim.facades.smdistributed.modelparallel.torch import _partitioning as partitioning
from acshim.facades.smdistributed.modelparallel.torch._pipeline_runner import (
    PipelinedSequential,
    StageRunner,
    partition_groups,
)
from acshim.facades.smdistributed.modelparallel.torch.exceptions import (
    CheckpointingConfigError,
    SMPUnsupportedError,
)
from acshim.facades.smdistributed.modelparallel.torch.patches.checkpoint import (
    apply_partitioned_checkpointing,
)

pytestmark = pytest.mark.usefixtures("fresh_smp")


@pytest.mark.parametrize(("strategy", "expected"), [
    ("each", [(0, (0,)), (0, (1,)), (1, (2,)), (1, (3,)), (1, (4,))]),
    ("contiguous", [(0, (0, 1)), (1, (2, 3, 4))]),
    ("group_3", [(0, (0, 1)), (1, (2, 3, 4))]),  # the seed's example: [a,b | c,d,e] -> (a,b), (c,d,e)
    ("group_2", [(0, (0, 1)), (1, (2, 3)), (1, (4,))]),
])
def test_groups_never_cross_a_partition_boundary(strategy, expected):
    assert partition_groups([0, 0, 1, 1, 1], strategy) == expected


def _blocks(n: int, width: int = 8) -> list[nn.Module]:
    return [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(n)]


def test_automatic_partitioning_balances_memory_and_keeps_sequential_children_whole():
    torch.manual_seed(0)
    # one child of the Sequential holds most parameters: it must stay whole, on one partition
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 64), nn.Linear(64, 8)), *_blocks(3))
    costs = partitioning.measure(model, (torch.randn(4, 8),), {})
    partitions = partitioning.auto_assignment(model, 2, costs)
    by_module = dict(zip(partitioning.module_list(model), partitions))
    assert {by_module[m] for m in model[0].modules()} == {0}
    assert [by_module[child] for child in model] == [0, 1, 1, 1]
    # equal blocks split evenly, in call order
    model = nn.Sequential(*_blocks(4))
    partitions = partitioning.auto_assignment(model, 2, partitioning.measure(model, (torch.randn(4, 8),), {}))
    by_module = dict(zip(partitioning.module_list(model), partitions))
    assert [by_module[child] for child in model] == [0, 0, 1, 1] and by_module[model] == 0


def test_activation_memory_moves_the_cut():
    torch.manual_seed(0)

    class Wide(nn.Module):  # as many parameters as a block, many more saved activations
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, x):
            return self.linear(x).repeat(1, 64).tanh().sum(-1, keepdim=True).expand(-1, 8).contiguous()

    model = nn.Sequential(Wide(), *_blocks(3))
    costs = partitioning.measure(model, (torch.randn(32, 8),), {})
    assert costs.activations[model[0]] > costs.activations[model[1][1]] > 0
    assert costs.params[model[0].linear] == costs.params[model[1][0]]
    partitions = partitioning.auto_assignment(model, 2, costs)
    by_module = dict(zip(partitioning.module_list(model), partitions))
    assert [by_module[child] for child in model] == [0, 1, 1, 1]


def test_the_trace_leaves_rng_and_buffers_as_they_were():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(3)
    x = torch.randn(8, 4)
    rng = torch.get_rng_state()
    partitioning.measure(model, (x,), {})
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_manual_placement_with_partition_context_and_set_partition(recwarn):
    smp.init({"pipeline_parallel_degree": 2, "auto_partition": False, "default_partition": 0})

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(2, 2)
            with smp.partition(1):
                self.b = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
            self.c = nn.Linear(2, 2)

    net = Net()
    smp.set_partition(net.c, 1)
    partitions = partitioning.manual_assignment(net, smp.state.placements, 0)
    named = dict(zip((n or "main" for n, _ in net.named_modules()), partitions))
    assert named == {"main": 0, "a": 0, "b": 1, "b.0": 1, "b.1": 1, "c": 1}
    with pytest.raises(ValueError, match=r"partition index must be an int in \[0, 2\)"):
        with smp.partition(2):
            pass


class Body(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x):
        return self.second(self.first(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = Body()
        self.seq = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))


def _runner(net: nn.Module, placed: dict[str, int], manual: bool) -> StageRunner:
    named = dict(net.named_modules())
    partitions = [placed.get(name, 0) for name in (n for n, _ in net.named_modules())]
    assert len(partitions) == len(named)
    return StageRunner(net, partitions, stage=0, ranks=[0, 1], manual=manual)


def test_split_checkpointed_module_is_an_error_when_manual_and_a_warning_when_automatic():
    net = Net()
    placed = {"body.second": 1}
    with pytest.raises(CheckpointingConfigError, match="'body': its module tree spans partitions \\[0, 1\\]"):
        apply_partitioned_checkpointing(_runner(net, placed, manual=True), net.body, True, False, "each")
    runner = _runner(net, placed, manual=False)
    with pytest.warns(UserWarning, match="split module 'body' across partitions \\[0, 1\\]: it won't be checkpointed"):
        apply_partitioned_checkpointing(runner, net.body, True, False, "each")
    assert "forward" not in net.body.__dict__, "the split module runs without checkpointing"


def test_sequential_spanning_partitions_runs_groups_on_their_partitions():
    net = Net()
    runner = _runner(net, {"seq.2": 1}, manual=True)
    apply_partitioned_checkpointing(runner, net.seq, True, False, "contiguous")
    forward = net.seq.__dict__["forward"]
    assert isinstance(forward, PipelinedSequential)
    assert forward.groups == [(0, (0, 1)), (1, (2,))]


def test_parameters_shared_across_partitions_are_refused():
    net = Net()
    net.seq[2].weight = net.seq[0].weight
    with pytest.raises(SMPUnsupportedError, match="seq.2.weight is shared by modules on partitions 0 and 1"):
        _runner(net, {"seq.2": 1}, manual=True)


class _Holder:
    def __init__(self, tensor):
        self.tensor = tensor


def test_values_crossing_a_boundary_keep_every_tensor_visible_to_autograd():
    from collections import OrderedDict
    from dataclasses import dataclass

    from transformers.modeling_outputs import BaseModelOutput

    from acshim.facades.smdistributed.modelparallel.torch._pipeline_transport import pack, unpack

    @dataclass
    class Out:
        y: torch.Tensor
        calls: int

    a, b, c, d = (torch.full((2,), float(i)) for i in range(4))
    value = {"ordered": OrderedDict(x=a), "dataclass": Out(b, 3), "hf": BaseModelOutput(last_hidden_state=c),
             "rest": (d, "text", None)}
    skeleton, tensors = pack(value)
    assert [t is x for t, x in zip(tensors, (a, b, c, d))] == [True] * 4
    rebuilt = unpack(skeleton, [t + 10 for t in tensors])  # every tensor comes back from the list
    assert type(rebuilt["ordered"]) is OrderedDict and torch.equal(rebuilt["ordered"]["x"], a + 10)
    assert type(rebuilt["dataclass"]) is Out and rebuilt["dataclass"].calls == 3
    assert type(rebuilt["hf"]) is BaseModelOutput and torch.equal(rebuilt["hf"].last_hidden_state, c + 10)
    assert rebuilt["rest"][1:] == ("text", None) and torch.equal(rebuilt["rest"][0], d + 10)
    with pytest.raises(TypeError, match="_Holder holding tensors \\(tensor\\) crosses a pipeline partition boundary"):
        pack((_Holder(a),))


def test_budget_planner_with_pipeline_across_ranks_is_accepted_tensor_and_sharded_parallelism_refused(monkeypatch):
    from acshim import region
    from acshim.facades.smdistributed.modelparallel.torch import _require_supported_layout
    from acshim.facades.smdistributed.modelparallel.torch.config import parse_config
    from acshim.planner.session import PlanSession

    monkeypatch.setattr(region, "ROUTERS", [PlanSession("0.5")])  # what `acshim run --budget 0.5` installs
    _require_supported_layout(parse_config({"pipeline_parallel_degree": 2, "ddp": True}, use_environment=False), 2)
    for key, what in (("tensor_parallel_degree", "tensor parallelism"),
                      ("sharded_data_parallel_degree", "sharded data parallelism")):
        config = parse_config({key: 2, "ddp": True}, use_environment=False)
        with pytest.raises(SMPUnsupportedError, match=f"{key}=2 with 2 processes: acshim does not provide {what}"):
            _require_supported_layout(config, 2)
