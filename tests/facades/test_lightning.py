"""Lightning 2.6's ``FSDPStrategy(activation_checkpointing_policy=...)`` under ``acshim.install()``:
the strategy's activation-checkpointing step (``_setup_activation_checkpointing``, which
``FSDPStrategy.setup_module`` runs after wrapping in FSDP) builds acshim's wrappers, which recompute
on the engine with gradients bitwise equal to no checkpointing (dropout on) and are reported as
``lightning FSDPStrategy``. FSDP itself needs a GPU: Lightning refuses it on CPU.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
from torch import nn

pytest.importorskip("lightning", reason="absent upstream: lightning is not installed (pip install 'acshim[lightning]')")

from lightning.fabric.strategies import FSDPStrategy
from lightning.fabric.strategies.fsdp import _setup_activation_checkpointing

import acshim


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(16, 64), nn.Linear(64, 16), nn.Dropout(0.2)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + self.fc2(self.drop(torch.relu(self.fc1(x))))


@pytest.fixture
def installed() -> Iterator[None]:
    acshim.uninstall()
    acshim.install(dialects=["torch"], transformers=False)
    yield
    acshim.uninstall()


def _step(model: nn.Module) -> list[torch.Tensor]:
    torch.manual_seed(7)
    model(torch.randn(4, 16)).pow(2).mean().backward()
    return [p.grad for _, p in sorted(model.named_parameters(), key=lambda item: item[0].replace(
        "_checkpoint_wrapped_module.", ""))]


@pytest.mark.parametrize("policy", [{Block}, "deprecated"])
def test_fsdp_strategy_policy_wraps_blocks_in_acshim_wrappers_and_matches_bitwise(installed: None, policy: object) -> None:
    from acshim.facades.torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(3)], nn.Linear(16, 1))
    reference = copy.deepcopy(model)
    if policy == "deprecated":
        with pytest.deprecated_call(match="activation_checkpointing_policy"):
            strategy = FSDPStrategy(activation_checkpointing=Block)
    else:
        strategy = FSDPStrategy(activation_checkpointing_policy=policy)
    _setup_activation_checkpointing(model, strategy._activation_checkpointing_kwargs)
    wrappers = [m for m in model.modules() if isinstance(m, CheckpointWrapper)]
    assert len(wrappers) == 3 and all(w.acshim_dialect == "lightning FSDPStrategy" for w in wrappers)
    grads, expected = _step(model), _step(reference)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected, strict=True))
    assert [m.calls for m in model.modules() if isinstance(m, Block)] == [2, 2, 2]  # recomputed once each


def test_both_policy_arguments_raise_lightnings_error() -> None:
    with pytest.raises(ValueError, match="You cannot set both `activation_checkpointing` and"):
        FSDPStrategy(activation_checkpointing=Block, activation_checkpointing_policy={Block})


def test_fsdp_strategy_on_cpu_is_refused_by_lightning_itself() -> None:
    import lightning as L

    with pytest.raises(ValueError, match="FSDP is only available on GPU"):
        L.Fabric(accelerator="cpu", devices=1, strategy=FSDPStrategy(activation_checkpointing_policy={Block}))


def test_report_names_the_regions_lightning_fsdp_strategy() -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACSHIM_", "PYTEST_"))}
    env.update(PYTHONPATH=str(repo), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "acshim", "run", "--report",
                           "examples/lightning_fsdp_activation_checkpointing.py"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "lightning FSDPStrategy     4 region(s), 8 forwards, 8 recomputes" in done.stderr
