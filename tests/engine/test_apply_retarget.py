"""Applying again re-targets, never nests (issue 8, item 11): docs/engine.md's own sequence
``apply_checkpointing(model)`` then ``apply_checkpointing(model, EveryNth(2), reentrant=True)``
must leave the regions a fresh model gets from the second call alone, with its options."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import acshim
from acshim.region import STATS
from acshim.testing import GPT, assert_bitwise_equal, seeded, train_step

IDS = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(3))


def _counted_step(model: nn.Module) -> tuple[dict[str, torch.Tensor], int, int]:
    """One training step; its state and the region forwards and recomputes it ran."""
    forwards, recomputes = STATS.forwards, STATS.recomputes
    state = train_step(model, IDS)
    return state, STATS.forwards - forwards, STATS.recomputes - recomputes


def _fresh(policy: acshim.Policy | None = None, **options: object) -> nn.Module:
    model = seeded(GPT)
    acshim.apply_checkpointing(model, policy, **options)
    return model


def test_readme_sequence_leaves_what_a_fresh_model_gets() -> None:
    model = seeded(GPT)
    assert acshim.apply_checkpointing(model) == ["h.0", "h.1", "h.2", "h.3"]
    assert acshim.apply_checkpointing(model, acshim.EveryNth(2), reentrant=True) == ["h.0", "h.2"]
    fresh = _fresh(acshim.EveryNth(2), reentrant=True)
    assert acshim.checkpointed_modules(model) == acshim.checkpointed_modules(fresh) == ["h.0", "h.2"]
    assert all(model.h[i].forward.options.reentrant for i in (0, 2))
    assert "forward" not in vars(model.h[1]) and "forward" not in vars(model.h[3])

    state, forwards, recomputes = _counted_step(model)
    assert (forwards, recomputes) == (2, 2)
    fresh_state, fresh_forwards, _ = _counted_step(fresh)
    assert fresh_forwards == 2
    assert_bitwise_equal(fresh_state, state)
    assert_bitwise_equal(train_step(seeded(GPT), IDS), state)


def test_widening_again_and_changing_level_never_nests() -> None:
    model = _fresh(acshim.EveryNth(2), reentrant=True)
    assert acshim.apply_checkpointing(model) == ["h.0", "h.1", "h.2", "h.3"]
    assert not any(model.h[i].forward.options.reentrant for i in range(4))  # options of kept ones updated
    assert _counted_step(model)[1:] == (4, 4)

    # from blocks to the linear layers inside them: the block regions go, so nothing nests
    linears = acshim.apply_checkpointing(model, lambda name, m: name.startswith("h.") and isinstance(m, nn.Linear))
    assert acshim.checkpointed_modules(model) == linears and len(linears) == 16
    state, forwards, recomputes = _counted_step(model)
    assert (forwards, recomputes) == (16, 16)
    assert_bitwise_equal(train_step(seeded(GPT), IDS), state)


def test_policy_selecting_nothing_removes_earlier_regions() -> None:
    model = _fresh()
    with pytest.warns(UserWarning, match="selected no module"):
        assert acshim.apply_checkpointing(model, "no_such_module") == []
    assert acshim.checkpointed_modules(model) == []
    assert _counted_step(model)[1:] == (0, 0)


def test_regions_made_another_way_are_left_alone() -> None:
    """Only apply_checkpointing's own regions are re-targeted; ``checkpoint_module`` and facade
    regions (here FairScale's in-place checkpoint_wrapper) stay until removed explicitly."""
    from acshim.facades.fairscale.nn.checkpoint import checkpoint_wrapper

    model = seeded(GPT)
    acshim.apply_checkpointing(model)
    acshim.checkpoint_module(model.h[1], acshim.RegionOptions())  # h.1 and h.3 taken over
    checkpoint_wrapper(model.h[3])
    acshim.apply_checkpointing(model, acshim.EveryNth(2))
    assert acshim.checkpointed_modules(model) == ["h.0", "h.1", "h.2", "h.3"]
    assert_bitwise_equal(train_step(seeded(GPT), IDS), _counted_step(model)[0])
    assert acshim.remove_checkpointing(model) == ["h.0", "h.1", "h.2", "h.3"]
    assert all(not {"forward", "_acshim_applied_forward"} & set(vars(block)) for block in model.h)


@pytest.mark.parametrize("copier", [copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))], ids=["deepcopy", "pickle"])
def test_copies_re_target_too(copier) -> None:
    model = copier(_fresh())
    assert acshim.apply_checkpointing(model, acshim.EveryNth(2), reentrant=True) == ["h.0", "h.2"]
    assert acshim.checkpointed_modules(model) == ["h.0", "h.2"]
    assert _counted_step(model)[1:] == (2, 2)
