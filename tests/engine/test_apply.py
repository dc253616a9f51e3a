"""Applying policies to a model: in place, same state_dict keys, idempotent, reversible."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import acshim
from acshim.policy import strategy_groups
from acshim.testing import MLPBlock, assert_bitwise_equal, seeded, tiny_sequential, train_step


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.layers = nn.ModuleList(MLPBlock(16) for _ in range(4))
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (None, ["layers.0", "layers.1", "layers.2", "layers.3"]),
        (MLPBlock, ["layers.0", "layers.1", "layers.2", "layers.3"]),
        (("MLPBlock",), ["layers.0", "layers.1", "layers.2", "layers.3"]),
        ("layers.[13]", ["layers.1", "layers.3"]),
        ("re:layers\\.(0|2)", ["layers.0", "layers.2"]),
        (lambda m: isinstance(m, nn.Linear) and m.out_features == 2, ["head"]),
        (lambda name, m: name.endswith("fc1"), [f"layers.{i}.fc1" for i in range(4)]),
        (acshim.EveryNth(2), ["layers.0", "layers.2"]),
        (acshim.EveryNth(2, start=1), ["layers.1", "layers.3"]),
        (acshim.ByClass(nn.Linear), ["embed"] + [f"layers.{i}.fc{j}" for i in range(4) for j in (1, 2)] + ["head"]),
    ],
    ids=["auto", "class", "class-name", "glob", "regex", "predicate1", "predicate2", "every2", "every2-from1",
         "all-linear"],
)
def test_policies_select_expected_modules(policy, expected) -> None:
    model = seeded(Net)
    assert acshim.apply_checkpointing(model, policy) == expected
    assert acshim.checkpointed_modules(model) == expected


def test_outermost_match_wins_so_regions_do_not_nest() -> None:
    model = seeded(Net)
    assert acshim.apply_checkpointing(model, (MLPBlock, nn.Linear)) == ["embed", *[f"layers.{i}" for i in range(4)],
                                                                         "head"]


def test_apply_is_in_place_idempotent_and_reversible() -> None:
    model = seeded(Net)
    x = torch.randn(4, 8)
    keys = list(model.state_dict())
    params = [id(p) for p in model.parameters()]
    plain = train_step(seeded(Net), x)
    acshim.apply_checkpointing(model)
    acshim.apply_checkpointing(model, reentrant=True)  # re-targets, does not nest
    assert list(model.state_dict()) == keys and [id(p) for p in model.parameters()] == params
    forward = model.layers[0].forward
    assert forward.options.reentrant and forward.replaced is not forward
    assert_bitwise_equal(plain, train_step(model, x))
    assert acshim.remove_checkpointing(model) == [f"layers.{i}" for i in range(4)]
    assert "forward" not in model.layers[0].__dict__ and acshim.checkpointed_modules(model) == []


def test_remove_restores_a_previous_instance_forward() -> None:
    block = MLPBlock(8)
    custom = block.forward  # a bound method stored as an instance override
    block.forward = custom
    acshim.checkpoint_module(block, acshim.RegionOptions())
    acshim.uncheckpoint_module(block)
    assert block.__dict__["forward"] is custom


def test_checkpointed_model_deep_copies_and_pickles_onto_itself() -> None:
    model = seeded(Net)
    acshim.apply_checkpointing(model)
    x = torch.randn(4, 8)
    clone = copy.deepcopy(model)
    restored = pickle.loads(pickle.dumps(model))
    for other in (clone, restored):
        assert other.layers[0].forward.module is other.layers[0]
        with torch.no_grad():
            other.layers[0].fc1.weight.zero_()  # a change to the copy must not reach the original
    assert model.layers[0].fc1.weight.abs().sum() > 0
    assert_bitwise_equal(train_step(seeded(Net), x), train_step(model, x))
    assert_bitwise_equal(train_step(copy.deepcopy(seeded(Net)), x), train_step(copy.deepcopy(model), x))


@pytest.mark.parametrize(("strategy", "groups"), [
    ("each", [(0,), (1,), (2,), (3,), (4,)]),
    ("contiguous", [(0, 1, 2, 3, 4)]),
    ("group_2", [(0, 1), (2, 3), (4,)]),
    ("group_3", [(0, 1, 2), (3, 4)]),
])
def test_sequential_strategies_group_children(strategy: str, groups: list[tuple[int, ...]]) -> None:
    assert strategy_groups(strategy, 5) == groups
    x = torch.randn(4, 16)
    plain = train_step(seeded(lambda: tiny_sequential(5, 16)), x)
    model = seeded(lambda: tiny_sequential(5, 16))
    acshim.apply_checkpointing(model, acshim.SequentialStrategy(strategy))
    calls = []
    for i, child in enumerate(model):
        child.register_forward_pre_hook(lambda m, a, i=i: calls.append(i))
    assert_bitwise_equal(plain, train_step(model, x))
    # every group runs once in forward and once in its recompute; groups recompute in reverse order
    forward, recompute = calls[:5], calls[5:]
    assert forward == list(range(5))
    assert recompute == [i for g in reversed(groups) for i in g]


def test_more_grouping_holds_less_memory() -> None:
    x = torch.randn(64, 32)
    held = {}
    for strategy in ("each", "group_2", "contiguous"):
        model = seeded(lambda: tiny_sequential(4, 32))
        acshim.apply_checkpointing(model, acshim.SequentialStrategy(strategy))
        held[strategy] = acshim.measure_memory(model, x, blocks=list(model.named_children())).held_bytes
    assert held["contiguous"] < held["group_2"] < held["each"]


def test_bad_input_gives_clear_errors_and_leaves_model_untouched() -> None:
    model = seeded(Net)
    with pytest.raises(ValueError, match="Unknown activation checkpointing strategy 'pairs'.*group_<N>"):
        acshim.SequentialStrategy("pairs")
    with pytest.raises(TypeError, match="groups the children of an nn.Sequential"):
        acshim.apply_checkpointing(model, acshim.SequentialStrategy("each"))
    with pytest.raises(TypeError, match="policy must be a Policy"):
        acshim.apply_checkpointing(model, 42)
    with pytest.raises(TypeError, match="unknown checkpointing option.*reentrnt"):
        acshim.apply_checkpointing(model, reentrnt=True)
    with pytest.raises(TypeError, match="needs an nn.Module"):
        acshim.apply_checkpointing("model")
    with pytest.raises(ValueError, match="EveryNth needs a whole number n >= 1"):
        acshim.EveryNth(0)
    with pytest.raises(TypeError, match="ByClass takes nn.Module subclasses"):
        acshim.ByClass(int)
    assert acshim.checkpointed_modules(model) == []
