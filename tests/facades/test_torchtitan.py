"""torchtitan 0.3's activation-checkpointing configs under ``acshim run``: ``MemoryBudgetAC.Config
(memory_budget=b)`` (upstream: only ``torch._functorch.config.activation_memory_budget``, nothing in
eager mode) honoured in eager by acshim's planner with ``b`` as torch means it (0.0 full recompute's
activation memory, 1.0 no checkpointing's); ``FullAC`` and ``SelectiveAC`` on the engine through
torch's ``checkpoint_wrapper``, reported as torchtitan's; gradients bitwise equal to no checkpointing in every case. The real
torchtitan runs in subprocesses (the patches are process-wide)."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from acshim.planner.budget import BetweenBudget, parse_budget

REPO = Path(__file__).resolve().parents[2]
TESTED_TORCHTITAN = "0.3.0"
"""The torchtitan release these tests pin (docs/torchtitan.md: how CI installs it)."""
ABSENT = ("absent upstream: torchtitan is not installed here (pip install --no-deps torchtitan==0.3.0 and the "
          "packages docs/torchtitan.md lists)")


def _torchtitan():
    try:
        from torchtitan.distributed import activation_checkpoint
    except ImportError:
        pytest.skip(ABSENT)
    return activation_checkpoint


def test_between_budget_is_torchs_meaning_and_rejects_values_outside_0_1() -> None:
    assert BetweenBudget(0.0).between(30, 110) == 30  # full recompute's activation memory
    assert BetweenBudget(1.0).between(30, 110) == 110  # no checkpointing's
    assert BetweenBudget(0.5).between(30, 110) == 70
    assert parse_budget(0.5, 110) == 55  # acshim's own fractions stay of no checkpointing's peak
    for bad in (1.5, -0.1, True, "0.5"):
        with pytest.raises(ValueError, match=r"memory_budget must be a number in \[0, 1\]"):
            BetweenBudget(bad)


def test_config_keys_are_torchtitan_0_3s() -> None:
    """A torchtitan that renames or adds a key fails here, not silently in a run."""
    titan = _torchtitan()
    from importlib.metadata import version

    assert version("torchtitan") == TESTED_TORCHTITAN
    base = {"preserve_rng_state", "determinism_check", "debug"}
    assert {f.name for f in dataclasses.fields(titan.FullAC.Config)} == base
    assert {f.name for f in dataclasses.fields(titan.SelectiveAC.Config)} == base | {"force_recompute_mm_shapes_by_fqns"}
    assert {f.name for f in dataclasses.fields(titan.MemoryBudgetAC.Config)} == base | {
        "memory_budget", "visualize_memory_budget_pareto"}
    assert callable(titan.MemoryBudgetAC.apply)  # what acshim.facades.torchtitan patches
    assert "apply" in vars(titan.ActivationCheckpointing)  # and FullAC's and SelectiveAC's, inherited


SCRIPT = '''
import ctypes, hashlib, sys
import torch
from torch import nn
from torchtitan.distributed.activation_checkpoint import FullAC, MemoryBudgetAC, SelectiveAC

torch.manual_seed(0)
torch.set_num_threads(1)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Dropout(0.1), nn.Linear(1024, 256))

    def forward(self, x):
        return x + self.mlp(x)


class Model(nn.Module):  # torchtitan's layout: the blocks in model.layers
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): Block() for i in range(8)})
        self.head = nn.Linear(256, 16)

    def forward(self, x):
        for layer in self.layers.values():
            x = layer(x)
        return self.head(x)


def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024


model = Model()
kind = sys.argv[1]
if kind == "budget":
    MemoryBudgetAC.Config(memory_budget=float(sys.argv[2])).build().apply(model)
elif kind == "full":
    FullAC.Config().build().apply(model)
elif kind == "selective":
    SelectiveAC.Config(force_recompute_mm_shapes_by_fqns=["mlp.3"]).build().apply(model)
x = torch.randn(1024, 256)
digests = []
for step in range(3):
    model.zero_grad(set_to_none=True)
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    open("/proc/self/clear_refs", "w").write("5")
    base = status("VmRSS:")
    torch.manual_seed(step)
    model(x).square().mean().backward()
    peak = status("VmHWM:") - base
    digests.append(hashlib.sha256(b"".join(p.grad.numpy().tobytes() for p in model.parameters())).hexdigest())
print("PEAK", peak)
print("GRADS", " ".join(digests))
'''

RUNS = {"none": ("none",), "full": ("full",), "selective": ("selective",), "budget-0.0": ("budget", "0.0"),
        "budget-0.5": ("budget", "0.5")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    """Each configuration once: plain python without checkpointing, the others under
    ``acshim run --report``; the last step's RSS peak, every step's gradient digest, stderr."""
    _torchtitan()
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux /proc to measure RSS")
    directory = tmp_path_factory.mktemp("torchtitan")
    (directory / "train.py").write_text(SCRIPT)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = {}
    for name, args in RUNS.items():
        prefix = [] if name == "none" else ["-m", "acshim", "run", "--report"]
        done = subprocess.run([sys.executable, *prefix, "train.py", *args], cwd=directory, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{name}: {done.stderr[-3000:]}"
        lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.startswith(("PEAK", "GRADS")))
        out[name] = {"peak": int(lines["PEAK"]), "grads": lines["GRADS"], "stderr": done.stderr}
    return out


def _recomputes(stderr: str, dialect: str) -> int:
    found = re.search(rf"^  {re.escape(dialect)}\s+\d+ region\(s\), \d+ forwards, (\d+) recomputes", stderr, re.M)
    assert found, stderr[-2000:]
    return int(found.group(1))


def test_full_and_selective_configs_run_on_the_engine_bitwise(runs) -> None:
    for name in ("full", "selective"):
        assert runs[name]["grads"] == runs["none"]["grads"], name  # every step, bitwise
        assert _recomputes(runs[name]["stderr"], "torchtitan") == 3 * 8, name  # FullAC/SelectiveAC build the wrappers
    assert runs["full"]["peak"] < runs["selective"]["peak"] < runs["none"]["peak"], {k: v["peak"] for k, v in runs.items()}


def test_memory_budget_config_is_planned_in_eager_mode_as_torch_means_the_budget(runs) -> None:
    """0.5 lies between full recompute's and no checkpointing's peak, 0.0 near full recompute's; the
    plan replaced torchtitan's blocks (named in the report), gradients bitwise equal every step."""
    peaks = {name: value["peak"] for name, value in runs.items()}
    for name in ("budget-0.0", "budget-0.5"):
        assert runs[name]["grads"] == runs["none"]["grads"], name
        assert "replaced 8 region(s) (8 torchtitan: recompute) by the plan" in runs[name]["stderr"], \
            runs[name]["stderr"][-2000:]
        assert re.search(r"^  torchtitan\s+8 region\(s\)", runs[name]["stderr"], re.M), name
    assert peaks["budget-0.5"] < 0.75 * peaks["none"], peaks
    assert peaks["budget-0.0"] < peaks["budget-0.5"], peaks
    halfway = (peaks["full"] + peaks["none"]) / 2
    assert peaks["budget-0.5"] < halfway * 1.1 and peaks["budget-0.0"] < peaks["full"] * 1.25, peaks
    print("RSS peak of the third step (bytes):", peaks)
