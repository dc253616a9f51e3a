"""SMP v1 activation checkpointing through the facade: exact gradients, grouping, memory, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import acshim
import acshim.facades.smdistributed.modelparallel.torch as smp
from acshim.facades.smdistributed.modelparallel.torch.exceptions import (
    CheckpointingConfigError,
    DistributedModelNotWrappedError,
)
from acshim.facades.smdistributed.modelparallel.torch.patches.checkpoint import (
    checkpoint,
    checkpoint_sequential,
)
from acshim.measure import measure_memory
from acshim.testing import (
    MLPBlock,
    assert_bitwise_equal,
    hf_inputs,
    hf_model,
    seeded,
    tiny_sequential,
    train_step,
)

pytestmark = pytest.mark.usefixtures("fresh_smp")


class CountingLinear(nn.Linear):
    """A Linear that counts its forward calls and logs (tag, recomputing) for each."""

    def __init__(self, *args, tag=None, log=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls, self.tag, self.log = 0, tag, log

    def forward(self, x):
        self.calls += 1
        if self.log is not None:
            self.log.append((self.tag, acshim.is_recomputing()))
        return super().forward(x)


class ConvNet(nn.Module):
    """The dev guide's first example: ``x = checkpoint(self.fc1, x)`` inside ``forward``."""

    def __init__(self, use_checkpoint=True):
        super().__init__()
        self.use_checkpoint = use_checkpoint
        self.conv1 = nn.Conv2d(1, 4, 3, 1)
        self.dropout = nn.Dropout(0.25)
        self.fc1 = CountingLinear(4 * 3 * 3, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = torch.flatten(self.dropout(x), 1)
        x = checkpoint(self.fc1, x) if self.use_checkpoint else self.fc1(x)
        x = self.dropout(F.relu(x))
        return F.log_softmax(self.fc2(x), dim=1)


def test_checkpoint_fc1_in_forward_matches_plain_run_and_recomputes_once():
    inputs = torch.randn(4, 1, 8, 8)
    plain = seeded(lambda: ConvNet(use_checkpoint=False))
    checkpointed = seeded(ConvNet)
    assert_bitwise_equal(train_step(plain, inputs), train_step(checkpointed, inputs))
    assert plain.fc1.calls == 1
    assert checkpointed.fc1.calls == 2  # forward + one recompute in backward


class KeywordBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.2)

    def forward(self, x, *, extras, scale=1.0):
        hidden = self.drop(self.fc(x)) * scale + extras["bias"] * extras["pair"][1]
        return {"out": hidden, "aux": (hidden.sum(), "tag")}


def test_checkpoint_accepts_kwargs_and_nested_structures():
    def run(use_checkpoint):
        block = seeded(KeywordBlock)
        x = torch.randn(3, 16, requires_grad=True)
        bias = torch.randn(16, requires_grad=True)
        pair = (None, torch.randn(16, requires_grad=True))
        torch.manual_seed(1)
        kwargs = {"extras": {"bias": bias, "pair": pair}, "scale": 0.5}
        out = checkpoint(block, x, **kwargs) if use_checkpoint else block(x, **kwargs)
        assert out["aux"][1] == "tag"
        (out["out"].square().sum() + out["aux"][0]).backward()
        return {"x": x.grad, "bias": bias.grad, "pair": pair[1].grad, "w": block.fc.weight.grad}

    expected, actual = run(False), run(True)
    assert all(torch.equal(expected[k], actual[k]) for k in expected)


def test_checkpoint_rejects_plain_callables():
    with pytest.raises(TypeError, match="is not a Module.*cannot take a plain function"):
        checkpoint(torch.relu, torch.randn(2))
    with pytest.raises(AssertionError):  # upstream asserted; both exception types are caught
        checkpoint(lambda x: x, torch.randn(2))


def test_checkpoint_without_preserve_rng_state_draws_new_dropout_masks():
    def grads(preserve):
        model = seeded(lambda: nn.Sequential(nn.Linear(32, 32), nn.Dropout(0.5), nn.Linear(32, 1)))
        x = torch.randn(8, 32)
        torch.manual_seed(1)
        checkpoint(model, x, preserve_rng_state=preserve).sum().backward()
        return model[0].weight.grad

    assert torch.equal(grads(True), grads(True))
    assert not torch.equal(grads(True), grads(False))


class SequentialNet(nn.Module):
    """The dev guide's second example: ``checkpoint_sequential`` over an ``nn.Sequential``."""

    def __init__(self, strategy=None, depth=5):
        super().__init__()
        self.strategy = strategy
        self.seq = tiny_sequential(depth, width=32)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        x = checkpoint_sequential(self.seq, x, strategy=self.strategy) if self.strategy else self.seq(x)
        return self.head(x)


@pytest.mark.parametrize("strategy", ["each", "contiguous", "group_2", "group_3"])
def test_checkpoint_sequential_strategy_matches_plain_run(strategy):
    inputs = torch.randn(4, 32)
    expected = train_step(seeded(SequentialNet), inputs)
    assert_bitwise_equal(expected, train_step(seeded(lambda: SequentialNet(strategy)), inputs))


def _logged_sequential(n, log):
    return nn.Sequential(*[CountingLinear(8, 8, tag=i, log=log) for i in range(n)])


@pytest.mark.parametrize(("strategy", "recompute_order"), [
    ("each", [4, 3, 2, 1, 0]),
    ("contiguous", [0, 1, 2, 3, 4]),
    ("group_2", [4, 2, 3, 0, 1]),  # (0,1) (2,3) (4): the last group is shorter
    ("group_3", [3, 4, 0, 1, 2]),  # (0,1,2) (3,4)
])
def test_group_n_chunks_children_with_a_shorter_last_chunk(strategy, recompute_order):
    log = []
    seq = seeded(lambda: _logged_sequential(5, log))
    checkpoint_sequential(seq, torch.randn(2, 8, requires_grad=True), strategy=strategy).sum().backward()
    forward = [tag for tag, recomputing in log if not recomputing]
    recomputed = [tag for tag, recomputing in log if recomputing]
    assert forward == [0, 1, 2, 3, 4]
    # backward recomputes region by region, last region first; each region replays its children in order
    assert recomputed == recompute_order
    assert all(child.calls == 2 for child in seq)


def test_checkpoint_sequential_rejects_unknown_strategy_and_non_sequential():
    seq = tiny_sequential(2, width=8)
    with pytest.raises(ValueError, match="Unknown activation checkpointing strategy 'groups_2'"):
        checkpoint_sequential(seq, torch.randn(2, 8), strategy="groups_2")
    with pytest.raises(ValueError, match="group_<N>"):
        checkpoint_sequential(seq, torch.randn(2, 8), strategy="group_0")
    with pytest.raises(TypeError, match="can only be used with nn.Sequential modules"):
        checkpoint_sequential(nn.ModuleList(seq), torch.randn(2, 8))


class TupleLayer(nn.Module):
    """A layer of a ``seq_layers`` stack: takes and returns ``(hidden_states, attention_mask)``."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.1)

    def forward(self, packed):
        hidden, mask = packed
        return hidden + self.drop(torch.tanh(self.fc(hidden))) * mask, mask


@pytest.mark.parametrize("strategy", ["each", "group_2"])
def test_pack_args_as_tuple_gives_every_tuple_member_its_gradient(strategy):
    def run(use_checkpoint):
        seq = seeded(lambda: nn.Sequential(*[TupleLayer() for _ in range(3)]))
        hidden = torch.randn(2, 16, requires_grad=True)
        mask = torch.rand(2, 16, requires_grad=True)
        torch.manual_seed(1)
        if use_checkpoint:
            out, _ = checkpoint_sequential(seq, (hidden, mask), strategy=strategy, pack_args_as_tuple=True)
        else:
            out, _ = seq((hidden, mask))
        out.square().sum().backward()
        return [hidden.grad, mask.grad, *(p.grad for p in seq.parameters())]

    expected, actual = run(False), run(True)
    assert all(torch.equal(e, a) for e, a in zip(expected, actual, strict=True))


# ---- set_activation_checkpointing --------------------------------------------------------------


def _wrapped(factory):
    smp.init({"partitions": 1})
    return smp.DistributedModel(seeded(factory))


@pytest.mark.parametrize("strategy", ["each", "contiguous", "group_2"])
def test_set_activation_checkpointing_sequential_matches_plain_run_in_place(strategy):
    inputs = torch.randn(4, 32)
    expected = train_step(seeded(lambda: tiny_sequential(4, width=32)), inputs)
    model = _wrapped(lambda: tiny_sequential(4, width=32))
    seq = model.get_module()
    keys = list(model.state_dict())
    smp.set_activation_checkpointing(seq, strategy=strategy)
    assert model.get_module() is seq and list(model.state_dict()) == keys
    actual = train_step(model, inputs)
    assert_bitwise_equal(expected, {k.replace("grad:module.", "grad:").replace("buffer:module.", "buffer:"): v
                                    for k, v in actual.items()})


def test_set_activation_checkpointing_on_each_child_recomputes_each_child_once():
    log = []
    model = _wrapped(lambda: _logged_sequential(3, log))
    for child in model.get_module().children():
        smp.set_activation_checkpointing(child)
    model(torch.randn(2, 8, requires_grad=True)).sum().backward()
    assert [tag for tag, recomputing in log if recomputing] == [2, 1, 0]


def test_set_activation_checkpointing_errors_name_the_problem():
    plain = nn.Linear(4, 4)
    with pytest.raises(DistributedModelNotWrappedError, match="wrapped with smp.DistributedModel before"):
        smp.set_activation_checkpointing(plain)
    model = _wrapped(lambda: nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4))))
    inner = model.get_module()[0]
    with pytest.raises(CheckpointingConfigError, match="strategy can only be used when checkpointing Sequential"):
        smp.set_activation_checkpointing(inner, strategy="group_2")
    with pytest.raises(CheckpointingConfigError, match="pack_args_as_tuple can only be used"):
        smp.set_activation_checkpointing(inner, pack_args_as_tuple=True)
    with pytest.raises(ValueError, match="Unknown activation checkpointing strategy"):
        smp.set_activation_checkpointing(model.get_module(), strategy="every_other")
    with pytest.raises(CheckpointingConfigError, match="not part of the model"):
        smp.set_activation_checkpointing(plain)
    with pytest.raises(CheckpointingConfigError, match="Only a module of type nn.Module"):
        smp.set_activation_checkpointing(torch.relu)
    assert acshim.checkpointed_modules(model) == []  # nothing half-applied


def test_set_activation_checkpointing_on_hf_gpt2_layers_matches_plain_run_and_holds_less():
    """The dev guide's third example on a tiny GPT-2: checkpoint every ``transformer.h`` block."""
    inputs = dict(hf_inputs("gpt2"), use_cache=False)
    expected = train_step(hf_model("gpt2"), inputs)
    baseline = measure_memory(hf_model("gpt2"), inputs, backward=False)

    smp.init({"partitions": 1})
    model = smp.DistributedModel(hf_model("gpt2"))
    for block in model.get_module().transformer.h.children():
        smp.set_activation_checkpointing(block)

    @smp.step
    def train(model, input_ids, labels):
        loss = model(input_ids=input_ids, labels=labels, use_cache=False).loss
        model.backward(loss)
        return loss

    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    loss = train(model, inputs["input_ids"], inputs["labels"])
    assert torch.equal(loss.reduce_mean(), expected["loss"])
    grads = {f"grad:{n}": p.grad for n, p in model.get_module().named_parameters()}
    assert grads.keys() == {k for k in expected if k.startswith("grad:")}
    assert all(torch.equal(expected[k], grads[k]) for k in grads)

    checkpointed = measure_memory(model.get_module(), inputs, backward=False)
    assert checkpointed.held_bytes < 0.7 * baseline.held_bytes


def test_grouping_more_children_holds_less_memory():
    """each < none, and contiguous <= group_2 <= each: fewer regions keep fewer boundary inputs."""
    inputs = torch.randn(8, 64)
    held = {"none": measure_memory(seeded(lambda: tiny_sequential(6)), inputs).held_bytes}
    for strategy in ("each", "group_2", "group_3", "contiguous"):
        seq = seeded(lambda: tiny_sequential(6))
        smp.state.reset()
        smp.init({})
        smp.DistributedModel(seq)
        smp.set_activation_checkpointing(seq, strategy=strategy)
        held[strategy] = measure_memory(seq, inputs).held_bytes
    assert held["each"] < 0.5 * held["none"]
    assert held["contiguous"] < held["group_3"] < held["group_2"] < held["each"]


def test_set_activation_checkpointing_on_module_list_warns_it_has_no_effect():
    model = _wrapped(lambda: nn.ModuleDict({"layers": nn.ModuleList([MLPBlock(8)])}))
    with pytest.warns(UserWarning, match="never called itself"):
        smp.set_activation_checkpointing(model.get_module()["layers"])
