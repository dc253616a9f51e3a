"""Planning must not touch the script's gradients outside the model: ``acshim run --budget`` plans
inside the first step, running forward and backward many times. Those backwards used to run from the
script's own inputs and reached the leaves they came from, adding into the ``.grad`` of an input that
requires grad (adversarial or input-gradient training): a silent wrong gradient, 10^9 times the true
one here. Planning now runs on detached inputs; every gradient is bitwise the plain run's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import acshim

SCRIPT = """
import sys, torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
torch.manual_seed(0)
model = nn.Sequential(*(checkpoint_wrapper(nn.Sequential(nn.Linear(512, 512), nn.GELU(), nn.Dropout(0.1)))
                        for _ in range(6)))
x = torch.randn(2048, 512, requires_grad=True)      # an input the step differentiates
scale = torch.randn(2048, 512, requires_grad=True)  # a leaf used after the model
for step in range(3):
    (model(x * 1.0) * scale).square().mean().backward()
torch.save({"x": x.grad, "scale": scale.grad, **{k: v.grad for k, v in model.named_parameters()}}, sys.argv[1])
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the process's memory is read from /proc")
def test_run_budget_leaves_input_gradients_bitwise(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def run(*prefix: str, output: str) -> dict[str, torch.Tensor]:
        done = subprocess.run([sys.executable, *prefix, "train.py", output], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        if prefix:
            assert "replaced 6 region(s)" in done.stderr, done.stderr[-3000:]
        return torch.load(tmp_path / output)

    reference = run(output="plain.pt")
    planned = run("-m", "acshim", "run", "--budget", "0.8", output="planned.pt")
    assert set(planned) == set(reference)
    assert [name for name in reference if not torch.equal(planned[name], reference[name])] == []


def test_plan_api_leaves_the_batch_gradient_alone() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(4)))
    batch = torch.randn(32, 64, requires_grad=True)
    acshim.plan(model, batch, budget=1.0, loss_fn=lambda out: out.square().mean(), verify=False, memory="tensors")
    assert batch.grad is None
    assert all(parameter.grad is None for parameter in model.parameters())
